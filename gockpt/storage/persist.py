"""The last stage: version F from host memory to a committed checkpoint on storage.

One background thread ("gockpt-persist") takes three kinds of work, in order, per job (and
calls handed to it, :meth:`Persister.queue_call`):

    open       at the boundary of F: the layout and small state are known, the writer opens
    captured   every block is captured: the last group and the static blocks are final
    persist    every block is at F and self-checked: write what is left, fsync, commit

Streaming (single rank): blocks are written as they reach F -- the last group when it is
captured, the others as the replay of step F finishes them (:meth:`blocks_final`, on the
replay thread); whatever is left (e.g. a step F skipped by GradScaler) is written at commit
time. ``sync`` mode persists inline (:meth:`persist`), inside ``save_checkpoint``.

The writer is looked up through the ``storage`` module at call time, so that it can be replaced.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from ..core import metrics as metrics_mod, runlog
from ..core.blocks import Block
from ..core.plan import Plan
from ..core.config import Config
from ..core.errors import GockptError, StorageError
from ..core.job import Job
from ..core.protocols import Committed, StorageWriter
from . import index
from .commit import apply_retention
from .layout import StoredLayout, stored_layout
from .schema import Manifest, ModelSection, OptimizerSection, PartsManifest, part_name
from .ranks import Ranks
from .writer import CheckpointWriter

log = logging.getLogger("gockpt")


class Work(enum.Enum):
    """The kinds of work queued to the persist thread (with a job, or a function)."""

    OPEN = "open"          # open the checkpoint's writer (at the boundary of F)
    CAPTURED = "captured"  # write what was captured (blocks not streamed)
    PERSIST = "persist"    # finish, vote, commit
    CALL = "call"          # run a function in order with the jobs' work


class Persister:
    """The persist thread of one Checkpointer.

    ``step_time`` and ``host_bytes`` are read when a checkpoint is written (for its metrics);
    ``publish(committed)`` hands each checkpoint the run directory commits to the other tiers
    (:class:`gockpt.tiers.Tiers`, on every rank: a collective where the memory tier is);
    ``on_durable(job)`` runs once a checkpoint is committed, before its handle is released.
    """

    def __init__(self, config: Config, plan: Plan, ranks: Ranks, optimizer_class: str,
                 step_time: Callable[[], float], host_bytes: Callable[[], int],
                 on_durable: Callable[[Job], None],
                 publish: Optional[Callable[[Committed], None]] = None):
        self.config, self.plan, self.ranks = config, plan, ranks
        self.publish = publish  # the other tiers: each committed checkpoint handed on
        self.optimizer_class = optimizer_class
        self.step_time, self.host_bytes, self.on_durable = step_time, host_bytes, on_durable
        self._layout_key, self._layout_cache = None, None
        self._indexed = (None, {})  # (the plan indexed, its global index)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()  # (C-level put: a hook queues)
        self._thread = threading.Thread(target=self._run, name="gockpt-persist", daemon=True)
        self._thread.start()

    def new_writer(self, root: str, name: str) -> StorageWriter:
        """The storage plugin's writer of checkpoint ``name`` in ``root`` (Config.storage_writer)."""
        factory = self.config.storage_writer or CheckpointWriter
        return factory(root, name)

    def queue_open(self, job: Job) -> None:
        self._queue.put((Work.OPEN, job))

    def queue_captured(self, job: Job) -> None:
        self._queue.put((Work.CAPTURED, job))

    def queue_persist(self, job: Job) -> None:
        self._queue.put((Work.PERSIST, job))

    def queue_call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the persist thread, in order with the jobs' work (the checks of a
        checkpoint copied without a replay, which then queue its persist)."""
        self._queue.put((Work.CALL, fn))

    def close(self) -> None:
        """Finish the queued work and stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        closing = False
        while True:
            if closing:  # close() asked: finish what is queued, also what the work queued
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return
            else:
                item = self._queue.get()
            if item is None:
                closing = True
                continue
            what, arg = item
            if what is Work.CALL:
                arg()
            elif what is Work.OPEN:
                self._open_writer(arg)
            elif what is Work.CAPTURED:
                self._write_captured(arg)
            else:
                self.persist(arg)

    # ------------------------------------------------------------------ streaming

    def _layout(self, job: Job) -> StoredLayout:
        """The stored tensors of ``job`` (known once the aligned state at F is)."""
        if job.stream.layout is None:
            # The same for every checkpoint of a plan while the aligned state keys stay: built
            # once (its loops over thousands of slots would hold the GIL at every checkpoint).
            key = (id(job.plan), id(job.host), job.host.keys_version,
                   tuple(sorted(job.aligned.items())))
            if self._layout_key != key:
                self._layout_key = key
                self._layout_cache = stored_layout(job.plan, job.host, job.aligned)
            job.stream.layout = self._layout_cache
        return job.stream.layout

    def _host_tensors(self, job: Job) -> Dict[str, torch.Tensor]:
        """Every tensor of this process's checkpoint, shaped as stored."""
        tensors = {name: st.view() for name, st in self._layout(job).tensors.items()}
        tensors.update(job.small_tensors)
        return tensors

    def _write_blocks(self, job: Job, blocks) -> None:
        """Queue ``blocks`` not written yet, as few ranges as possible (caller holds
        ``job.stream.lock``; writer open)."""
        new = [b for b in dict.fromkeys(blocks) if b not in job.stream.written]
        job.stream.written.update(new)
        for name, start, data in self._layout(job).ranges(new):
            job.stream.writer.write(name, data, start=start)

    def _open_writer(self, job: Job) -> None:
        if job.error is not None or job.dropped:
            return
        try:
            writer = self.new_writer(self.config.directory, job.name)
            try:
                writer.begin({name: (t.dtype, tuple(t.shape))
                              for name, t in self._host_tensors(job).items()})
                for name, t in job.small_tensors.items():
                    writer.write(name, t)
            except BaseException:
                writer.abort()
                raise
            with job.stream.lock:
                job.stream.writer = writer
                self._write_blocks(job, job.stream.waiting)
        except BaseException as exc:
            job.fail(exc if isinstance(exc, GockptError) else StorageError(
                f"opening the checkpoint of step {job.handle.final_step} in "
                f"{self.config.directory} failed: {exc}"))

    def _write_captured(self, job: Job) -> None:
        """Every block is captured: the last group (copied at F) and static ones are final."""
        with job.stream.lock:
            if job.stream.writer is None or job.error is not None:
                return
            try:
                self._write_blocks(job, job.capture.groups[-1] + [
                    b for b in job.capture.captured if job.plan.slots[b.slot].static])
            except BaseException as exc:
                err = exc
            else:
                return
        job.fail(self._storage_error(job, err))

    def blocks_final(self, job: Job, blocks: List[Block]) -> None:
        """Replay thread: ``blocks`` have reached version F -- but for a slot whose parameter
        is copied at F (``Slot.param_at_f``) only its moments have: such blocks are left for
        the commit, when the last group's copy of their parameter has landed too."""
        slots = job.plan.slots
        if any(slots[b.slot].param_at_f for b in blocks):
            blocks = [b for b in blocks if not slots[b.slot].param_at_f]
        with job.stream.lock:
            if job.stream.writer is None:
                job.stream.waiting.extend(blocks)
                return
            if job.error is not None:
                return
            try:
                self._write_blocks(job, blocks)
                return
            except BaseException as exc:
                err = exc
        job.fail(self._storage_error(job, err))

    def _storage_error(self, job: Job, exc: BaseException) -> BaseException:
        """``exc`` as the gockpt error that fails ``job`` (a plugin may raise plain OSErrors)."""
        if isinstance(exc, GockptError):
            return exc
        return StorageError(f"writing the checkpoint of step {job.handle.final_step} to "
                            f"{self.config.directory} failed: {exc}")

    # ------------------------------------------------------------------ commit

    def persist(self, job: Job) -> None:
        """Write, fsync and commit version F (on several ranks: together, see ranks.py)."""
        if job.stream.entered:
            return
        job.stream.entered = True
        if job.error is not None and not self.ranks.several:
            return  # failed before its persist came up (e.g. the writer could not open)
        t0 = time.perf_counter()
        writer = None
        name = job.name
        try:
            if self.ranks.several:
                write_part = None if job.error is not None else \
                    (lambda shared: self._write(job, shared, self.ranks.part_name(), t0,
                                                update_latest=False))
                top = PartsManifest(job.handle.final_step, job.metrics.start_step,
                                    self.config.mode, job.k,
                                    [part_name(r) for r in range(self.ranks.world_size)],
                                    replicated=self.config.replicated is True,
                                    shares=job.plan.share[1] > 1, index=self._index(job.plan))
                path = self.ranks.commit(self.config.directory, name, write_part, top,
                                         self.new_writer)
                if self.publish is not None:  # (committed on every rank: each takes part)
                    self.publish(Committed(name, self._host_tensors(job), job.stream.manifest,
                                           top))
                if job.error is not None:
                    return
            else:
                with job.stream.lock:
                    writer = job.stream.writer
                if writer is None:
                    writer = self.new_writer(self.config.directory, name)
                path = self._write(job, None, name, t0, writer=writer)
                if self.publish is not None:  # (from the host copy, still this job's)
                    self.publish(Committed(name, self._host_tensors(job), job.stream.manifest))
            m = job.metrics
            m.time_to_durable_s = time.perf_counter() - job.t_start
            m.time = time.time()
            every = self.ranks.gather(m)  # one line per rank: what each copied and wrote
            if self.ranks.rank == 0:
                for record in every:
                    metrics_mod.append(self.config.directory, record)
                apply_retention(self.config.directory, self.config.keep_last)
            self.on_durable(job)
            log.info("gockpt: checkpoint of step %d durable at %s", job.handle.final_step, path)
            job.durable(path)
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            job.fail(self._storage_error(job, exc))

    def _index(self, plan) -> dict:
        """The global index of ``plan``'s checkpoints (on rank 0; {} elsewhere): gathered from
        every rank when some rank's plan changed since the last checkpoint."""
        parts = self.ranks.gather_if(plan is not self._indexed[0],
                                     lambda: index.part_entries(plan))
        if parts is not None:
            self._indexed = (plan, index.merge(parts) if self.ranks.rank == 0 else {})
        return self._indexed[1]

    def _write(self, job: Job, root: Optional[str], name: str, t0: float, *, writer=None,
               update_latest: bool = True) -> str:
        """Write this process's tensors and manifest as checkpoint ``name`` in ``root``."""
        if writer is None:
            writer = self.new_writer(root, name)
        try:
            if job.stream.writer is writer and writer is not None:
                with job.stream.lock:  # streamed: write only what is left
                    self._write_blocks(job, job.capture.captured)
                writer_bytes = writer.finish()
            else:
                writer_bytes = writer.write_tensors(self._host_tensors(job))
            job.accounts_closed.wait()  # the last hook has charged its blocked time
            m = job.metrics
            m.copy_s = sum(t.seconds for t in list(job.capture.tickets.values()) + job.capture.grad_tickets)
            m.persist_s = time.perf_counter() - t0
            if self.config.policy.persists_inline:  # the write happened inside save_checkpoint
                m.add_blocked("save_checkpoint", m.persist_s)
            m.time_to_durable_s = time.perf_counter() - job.t_start
            m.step_time_s = self.step_time()
            m.host_bytes = self.host_bytes()
            m.rank, m.world_size = self.ranks.rank, self.ranks.world_size
            me = runlog.identity()
            m.pid, m.process_start = me["pid"], me["process_start"]
            m.written_bytes = writer_bytes
            manifest = Manifest(
                step=job.handle.final_step, start_step=m.start_step, mode=self.config.mode,
                overlap_steps=job.k, rank=self.ranks.rank, world_size=self.ranks.world_size,
                replicated=self.config.replicated is True,
                model=ModelSection(self._layout(job).param_refs, job.plan.aliases,
                                   {job.plan.slots[si].name: d for (si, key), d in
                                    job.digests.items() if key is None},
                                   index.part_slices(job.plan)),
                optimizer=OptimizerSection(self.optimizer_class, self._layout(job).state_refs,
                                           _state_digests(job),
                                           _state_params(job, self._layout(job).state_refs)),
                small=job.small, metrics=m.to_dict())
            t_commit = time.perf_counter()
            job.stream.manifest = manifest.to_json()
            path = writer.commit(job.stream.manifest, update_latest=update_latest)
            if self.config.policy.persists_inline:
                m.add_blocked("save_checkpoint", time.perf_counter() - t_commit)
            return path
        except BaseException:
            writer.abort()
            raise


def _state_params(job: Job, state_refs: Dict[int, dict]) -> Dict[int, str]:
    """The parameter of each optimizer state index whose aligned state this part stores."""
    return {s.opt_index: s.name for s in job.plan.slots if s.opt_index in state_refs}


def _state_digests(job: Job) -> Dict[int, Dict[str, str]]:
    """The verified digests of the optimizer state, by state index and key."""
    out: Dict[int, Dict[str, str]] = {}
    for (si, key), d in job.digests.items():
        if key is not None:
            out.setdefault(job.plan.slots[si].opt_index, {})[key] = d
    return out
