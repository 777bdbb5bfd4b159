"""The interfaces at the seams between stages, as ``typing.Protocol`` classes: what a stage may
ask of the object another one hands it, and in which order. Implementations are elsewhere (an
adapter per optimizer in :mod:`gockpt.replay.adapters` and the DeepSpeed integration; the
storage writer in :mod:`gockpt.storage.writer`, or a plugin)."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Protocol, Tuple

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

    def step_counts(self, slots: Iterable[int], states: list) -> Dict[int, float]: ...

    def scalars(self) -> Dict[int, GroupScalars]: ...

    def apply(self, record: StepRecord, host, threads: Optional[int]) -> None: ...

    def close(self) -> None: ...
