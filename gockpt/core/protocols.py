"""The interfaces at the seams between stages, as ``typing.Protocol`` classes: what a stage may
ask of the object another one hands it, and in which order. Implementations are elsewhere (an
adapter per optimizer in :mod:`gockpt.replay.adapters` and the DeepSpeed integration; the
storage writer in :mod:`gockpt.storage.writer`, or a plugin; the device in
:mod:`gockpt.capture.device`; the tiers in :mod:`gockpt.storage`'s ``*_tier`` modules, picked
among by :mod:`gockpt.tiers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Protocol, Tuple

from .records import GroupScalars, StepRecord


class ReplayAdapter(Protocol):
    """One optimizer's arithmetic, as the replay reproduces it bit for bit.

    Built when the Checkpointer attaches (it refuses there what it cannot reproduce); then, at
    each optimizer step that a checkpoint records, in this order: :meth:`skipped_by_scaler`
    (nothing to record), :meth:`unsupported_step` (the step cannot be replayed: copied at its
    step instead), :meth:`step_counts` and :meth:`scalars` (what the record holds); later, on
    the replay thread, :meth:`apply` of each record in arrival order; :meth:`close` when the
    Checkpointer closes or plans again."""

    state_keys: Tuple[str, ...]
    """The optimizer state tensors, shaped like their parameter, that the replay updates."""

    def skipped_by_scaler(self) -> bool: ...

    def unsupported_step(self) -> Optional[str]: ...

    def step_counts(self, slots: Iterable[int], states: list) -> Mapping[int, float]: ...

    def scalars(self) -> Dict[int, GroupScalars]: ...

    def params_not_replayed(self) -> Dict[int, str]:
        """``id(parameter)`` -> why its update is not reproduced, for parameters whose
        moments are (copied at F, moments replayed: ``gockpt.core.plan.Slot.param_at_f``);
        asked once, right after the adapter is built."""

    def apply(self, record: StepRecord, host, threads: Optional[int]) -> None: ...

    def close(self) -> None: ...


class StorageWriter(Protocol):
    """One checkpoint on its way to storage: what ``Config.storage_writer(root, name)`` returns
    (:class:`gockpt.storage.CheckpointWriter`, or a plugin, usually a subclass of it).

    Call order, from the persist thread unless said otherwise:

    1. ``begin(layout)`` once, when the layout is known (the boundary of F): every tensor's
       name -> ``(dtype, shape)``; the data file is laid out and opened.
    2. ``write(name, tensor, start=0)`` any number of times, from any thread (the replay
       thread streams blocks as they reach F), in any order: a tensor, or a flat element range
       of it starting at ``start``. The tensor's memory must stay unchanged until ``finish``.
       ``write_tensors(tensors)`` instead of 1-3 writes a whole dict at once (no streaming)
       and returns the bytes written.
    3. ``finish()`` once: waits for the writes, makes them durable and records the checksums;
       returns the bytes written.
    4. ``commit(manifest, update_latest=True)`` once: the manifest is written and sealed and the
       checkpoint renamed into place atomically; returns its final path.

    ``abort()`` may be called at any time, from any thread, and more than once: the temporary
    files go, nothing becomes visible (after a successful commit it does nothing). After any
    failure the writer has aborted itself and every later call raises
    :class:`~gockpt.core.errors.StorageError`.
    """

    def begin(self, layout: dict) -> None: ...

    def write(self, name: str, tensor, *, start: int = 0) -> None: ...

    def write_tensors(self, tensors: dict) -> int: ...

    def finish(self) -> int: ...

    def commit(self, manifest: dict, *, update_latest: bool = True) -> str: ...

    def abort(self) -> None: ...


@dataclass(frozen=True)
class Committed:
    """A checkpoint the run directory has just committed, as every tier is handed it."""

    name: str                 # its name in the run directory (``step-N`` or a tag)
    tensors: Dict[str, Any]   # this rank's stored tensors (the host copy at F, as on disk)
    manifest: dict            # this rank's manifest (its part's, on several ranks)
    top: Any = None           # on several ranks, the top manifest (``PartsManifest``)


class Tier(Protocol):
    """A place that also keeps a run's committed checkpoints: host memory
    (:class:`gockpt.storage.memory_tier.MemoryTier`) or an object store
    (:class:`gockpt.storage.remote_tier.RemoteTier`). The run directory is the tier that
    commits (the persist thread's writer); the others follow it, each in its own format-keeping
    place, and are read by the one reader as a directory is (their :class:`TierReader` says
    which checkpoint).

    Call order, on every rank (a tier with nothing to do on a rank does nothing there):

    1. ``publish(committed)`` for each checkpoint the run directory commits, in commit order,
       from the persist thread right after the commit -- before the Checkpointer counts it
       durable (its metrics line, the disk's retention): a committed checkpoint is one a
       restart may load, whatever becomes of the job after. It must not fail the checkpoint:
       what it cannot keep is a warning (the disk's stands). On several ranks it may be a
       collective (every rank calls it for the same checkpoint).
    2. ``finish(end_of_training)`` once, at ``close()``: what the tier owes the job before the
       process leaves (uploads waited for; copies only a restart needs removed at the end of
       training, kept when the process leaves on an exception).
    3. ``stop()`` last (also after ``abort()``, without ``finish``): its threads end now.
    """

    def publish(self, committed: Committed) -> None: ...

    def finish(self, end_of_training: bool) -> None: ...

    def stop(self) -> None: ...


class TierReader(Protocol):
    """Where a load finds a run's checkpoint in one tier
    (:class:`gockpt.storage.disk_tier.DiskReader`, :class:`gockpt.storage.memory_tier.MemoryReader`;
    :func:`gockpt.tiers.newest` asks them in one place). What it returns is read by the one
    reader of the format (:mod:`gockpt.storage.reader`: a directory, or an ``s3://`` URL) and
    checked there byte by byte; ``newest`` checks only what makes a copy worth trying."""

    def newest(self, run: str, disk: Optional[str]) -> Optional[str]:
        """The checkpoint of run directory ``run`` this tier holds and a load may take (its
        path), given ``disk``, the one the run directory holds (None: none); None when it has
        none worth trying. On several ranks it may be a collective."""
