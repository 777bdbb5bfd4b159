"""The gradients a step consumes, copied for the replay: in the optimizer's step pre-hook,
exactly what the update consumes, for the blocks captured before it (only those are replayed).

Three ways across (the transfer engine queues each): the gradients themselves (the update must
not start before they are read: gockpt), a device-side snapshot made at device memory speed
first and copied from there (the update overlaps the slow copy: gockpt-o), or bf16 images times
one multiplier made on the device (:mod:`.transport`; 2 bytes per element instead of 4).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import _tensors
from ..core.blocks import BlockTable
from ..core.errors import HookOrderError, UnsupportedOptimizerError
from ..core.job import Job
from ..core.lists import has_none
from ..core.memory import flat, is_dtensor, local
from ..core.protocols import ReplayAdapter
from ..core.records import StepRecord
from ..core.staging import SNAPSHOTS, GradPool
from .addresses import data_ptrs, in_memory_order
from .states import StateWatch
from .transfer import GRADIENT, SNAPSHOT, CopyEngine
from .transport import Bf16Transport

class GradientCopies:
    """Gradient records of the steps inside checkpoints' windows."""

    def __init__(self, engine: CopyEngine, states: StateWatch,
                 transport: Optional[Bf16Transport] = None):
        self.engine, self.states = engine, states
        self.transport = transport  # None: gradients cross in fp32
        # (plan, [two device-side gradient snapshots, each with the ticket of its D2H copy]):
        # a step's snapshot is written while the previous step's is still being copied
        self._snapshots = None
        self._stepped_slots = (None, {})  # (plan, {(table, groups): (table, slots, params)})
        self._rows: Dict[int, _SnapshotRows] = {}  # id(table) -> its snapshot copies' rows

    def snapshot_bytes(self) -> int:
        """Device memory held by the gradient snapshots (host memory on the CPU)."""
        if self._snapshots is None:
            return 0
        return sum(arena.nbytes() for arena, _ in self._snapshots[1])

    def record(self, job: Job, j: int, groups, grad_pool: GradPool, adapter: ReplayAdapter,
               snapshot: bool = False) -> Optional[StepRecord]:
        """Queue the copies of this step's gradients for the blocks captured so far of the
        planned param groups ``groups`` (the optimizer's ``param_groups`` now, in order: all
        of them, or the one DeepSpeed's ZeRO steps at a time); the record to replay, or None
        when GradScaler skips the step (nothing changes).

        With ``snapshot`` the gradients are first copied on the device (at device memory
        speed, before the update may start) and the slow device-to-host copy reads that
        snapshot: nothing the loop does to ``.grad`` afterwards can reach it (gockpt-o)."""
        if adapter.skipped_by_scaler():
            return None
        why = adapter.unsupported_step()
        if why:
            raise UnsupportedOptimizerError(f"this optimizer step cannot be replayed: {why}")
        stepped = {(j, gi) for gi in groups}
        new_step = all(r[0] != j for r in job.capture.recorded)
        if stepped & job.capture.recorded:
            raise HookOrderError("optimizer.step() ran twice in one training step; gockpt "
                                 "supports one optimizer step per save_checkpoint() boundary")
        job.capture.recorded |= stepped
        plan = job.plan
        table = job.capture.captured_table()  # only these gradients are replayed
        slots, params = self._stepped(plan, table, groups)
        if snapshot and self.transport is None:  # (the CPU's gockpt-o)
            record = self._record_snapshot(job, j, groups, grad_pool, adapter, table, slots,
                                           params, new_step)
            if record is not None:
                return record
        # a snapshot reads the gradients by address only: no Python object for each of them
        found = gradient_addresses(plan, slots, params) \
            if snapshot and self.transport is None else None
        if found is None:
            grads, at = live_gradients(plan, slots.tolist())
            slots = list(grads)
        else:
            grads, (slots, at) = None, found
        steps = adapter.step_counts(slots, self.states.of(job))
        if len(slots) < len(table.slots):  # (else every captured slot is stepped now)
            table = table.where(np.isin(table.slot, np.asarray(slots, dtype=np.int64)))
        # bf16: images made on the device now, so the copy reads them and not .grad (a
        # snapshot); fp32 when the transport is off or this step's images are not exact
        encoded = self.transport.encode({si: grads[si] for si in table.slots.tolist()},
                                        _extents(table) if at is not None else None) \
            if self.transport is not None else None
        dtype, mul = (torch.bfloat16, encoded[1]) if encoded else (torch.float32, 1.0)
        bufs = grad_pool.acquire()
        grad_base = grad_pool.arena(bufs, dtype).bases(len(plan.slots))
        # ``snapshot`` (ModePolicy.snapshots_gradients): a device-side copy of .grad is what the
        # overlapped copy reads; else .grad itself, the stream waiting for it
        snapshot = encoded is not None or snapshot
        if encoded is not None:  # private images, like a snapshot: after the state's copies
            ticket = self._copy(job, table, encoded[0], bufs, grad_pool, grad_base,
                                priority=SNAPSHOT)
            ticket.keep(encoded[0])  # the images the copy reads
        elif snapshot:
            ticket = self._copy_snapshot(job, table, grads, grad_base, at)
        else:
            ticket = self._copy(job, table, grads, bufs, grad_pool, grad_base, at)
        return _recorded(job, j, groups, adapter, steps, table, grad_pool, bufs, grad_base,
                         ticket, new_step, snapshot, dtype, mul,
                         self.transport.name if encoded else "fp32")

    def _record_snapshot(self, job: Job, j: int, groups, grad_pool: GradPool,
                         adapter: ReplayAdapter, table: BlockTable, slots: np.ndarray,
                         params: list, new_step: bool) -> Optional[StepRecord]:
        """:meth:`record` through a snapshot in the usual case -- every captured slot stepped
        now, every gradient a contiguous dense float32 tensor laid out like its parameter --
        with the copies' addresses worked out once per table (:class:`_SnapshotRows`) and
        the gradients read in one C++ pass that gives their sources: after a training step
        each numpy operation on this path costs tens of microseconds. None otherwise (the
        general path reads them its own way)."""
        plan = job.plan
        if plan.dtensors or not plan.contiguous or len(slots) != len(table.slots):
            return None
        rows = self._rows.get(id(table))
        if rows is None or rows.table is not table or rows.plan is not plan:
            rows = self._rows[id(table)] = _SnapshotRows(plan, table, slots)
        found = _tensors.grad_sources(params, rows.param_row, rows.offset)
        if found is None or found[2] != len(params) or found[1] != _USUAL_GRADIENT:
            return None
        steps = adapter.step_counts(slots, self.states.of(job))
        bufs = grad_pool.acquire()
        grad_base = grad_pool.arena(bufs, torch.float32).bases(len(plan.slots))
        arena = self._next_snapshot(plan)
        snap = rows.dst(arena.bases(len(plan.slots)))
        self.engine.device.copy_now(snap, found[0], rows.nbytes)
        ticket = self._snapshots[1][-1][1] = self.engine.submit_own(rows.dst(grad_base), snap,
                                                                    rows.nbytes, SNAPSHOT)
        return _recorded(job, j, groups, adapter, steps, table, grad_pool, bufs, grad_base,
                         ticket, new_step, True, torch.float32, 1.0, "fp32")

    def _next_snapshot(self, plan):
        """The snapshot arena to write now: the one written the longest ago, once its copy
        to the host has landed (the two alternate)."""
        device = self.engine.device
        if self._snapshots is None or self._snapshots[0] is not plan:
            extents = plan.extents(plan.optimized_slots)
            self._snapshots = (plan, [[device.device_arena(torch.float32, extents), None]
                                      for _ in range(SNAPSHOTS)])
            self._rows = {}
        ring = self._snapshots[1]
        ring.append(ring.pop(0))  # the one written the longest ago
        arena, previous = ring[-1]
        if previous is not None:  # its copy still reads the snapshot
            device.order_after(previous)
        return arena

    def _stepped(self, plan, table: BlockTable, groups) -> Tuple[np.ndarray, list]:
        """The slots of ``table`` the param groups ``groups`` step (int64: read without an int
        object each), and their parameters (kept while the captured table and the groups are
        the same: from one window to the next)."""
        if self._stepped_slots[0] is not plan:
            self._stepped_slots = (plan, {})
        key = (id(table), tuple(groups))
        seen = self._stepped_slots[1].get(key)
        if seen is None or seen[0] is not table:  # (one per captured table of the plan)
            slots = table.slots[plan.in_groups(groups)[table.slots]]
            seen = self._stepped_slots[1][key] = (table, slots,
                                                  list(map(plan.params.__getitem__, slots.tolist())))
        return seen[1], seen[2]

    def _copy_snapshot(self, job: Job, table: BlockTable, grads, grad_base: np.ndarray,
                       at: Optional[np.ndarray]):
        """Copy the gradients of ``table``'s blocks to a device-side snapshot now, then queue
        the device-to-host copy from it, after the state's copies (:data:`SNAPSHOT`). The
        snapshots alternate: one is written while the previous step's is still copied, which
        has the whole next step to land (only a snapshot's reuse waits for its copy).
        ``at``: per slot, the address of its gradient in its parameter's memory order (None:
        read here)."""
        device, plan = self.engine.device, job.plan
        arena = self._next_snapshot(plan)
        ring = self._snapshots[1]
        live, _ = _bases(job, table, grads, at)
        snap = arena.bases(len(plan.slots))
        offset, nbytes = table.start * 4, table.numel * 4  # float32 (the replay modes)
        device.copy_now(snap[table.slot] + offset, live[table.slot] + offset, nbytes)
        ticket = self.engine.submit_segments(grad_base[table.slot] + offset,
                                             snap[table.slot] + offset, nbytes, SNAPSHOT)
        ring[-1][1] = ticket
        return ticket

    def _copy(self, job: Job, table: BlockTable, grads, bufs, grad_pool: GradPool,
              grad_base: np.ndarray, at: Optional[np.ndarray] = None, priority=GRADIENT):
        """Queue the copies of ``grads`` (slot -> live gradient, or its bf16 image; ``at``:
        their addresses as :func:`_bases` takes them) for ``table``'s blocks into the gradient
        set ``bufs``, in the parameters' memory order."""
        return self.engine.submit_group(
            _GradientCopies(job, table, grads, bufs, grad_pool, grad_base, at), priority)


def _recorded(job: Job, j: int, groups, adapter: ReplayAdapter, steps, table: BlockTable,
              grad_pool: GradPool, bufs, grad_base: np.ndarray, ticket, new_step: bool,
              snapshot: bool, dtype: torch.dtype, mul: float, transport: str) -> StepRecord:
    """The record of window step ``j`` whose gradient copies ``ticket`` queued into the set
    ``bufs`` (at ``grad_base``), counted in the job's metrics and tickets."""
    scalars = {groups[i]: sc for i, sc in adapter.scalars().items()}
    record = StepRecord(j, scalars, steps, table, bufs, grad_base, ticket,
                        lambda bufs=bufs: grad_pool.release(bufs), ticket.nbytes,
                        final=j == job.k - 1, snapshot=snapshot, grad_dtype=dtype,
                        grad_mul=mul)
    job.metrics.add_grad_step(transport, ticket.nbytes, new_step)
    job.capture.grad_tickets.append(ticket)
    return record


class _SnapshotRows:
    """Where a step's gradient snapshot reads and writes each block of a captured table
    (float32): per row, its parameter's place among the stepped ones, the byte offset and
    size, and the destinations in each arena it is copied to (their slot bases: the two
    snapshots, the gradient sets), worked out once per table and arena."""

    def __init__(self, plan, table: BlockTable, slots: np.ndarray):
        self.plan, self.table = plan, table
        self.param_row = np.searchsorted(slots, table.slot)  # (slots: sorted, every row's)
        self.offset, self.nbytes = table.start * 4, table.numel * 4
        self._dst: Dict[int, tuple] = {}  # id(bases) -> (bases, the rows' destinations)

    def dst(self, bases: np.ndarray) -> np.ndarray:
        """The rows' destinations in the arena whose slot bases are ``bases`` (an arena's
        read-only cached array: the same object while the arena lives)."""
        found = self._dst.get(id(bases))
        if found is None or found[0] is not bases:
            found = self._dst[id(bases)] = (bases, bases[self.table.slot] + self.offset)
        return found[1]


class _GradientCopies:
    """One step's gradient copies in the form the device takes them (``device.CopyGroup``):
    memcpy segments into the set's arenas, or tensor pairs into its per-slot buffers."""

    def __init__(self, job: Job, table: BlockTable, grads, bufs, grad_pool: GradPool,
                 grad_base: np.ndarray, at: Optional[np.ndarray] = None):
        self.job, self.table, self.grads, self.at = job, table, grads, at
        self.bufs, self.grad_pool, self.grad_base = bufs, grad_pool, grad_base

    def segments(self):
        table, grads = self.table, self.grads
        live, keep = _bases(self.job, table, grads, self.at)
        item = next(iter(grads.values())).element_size() if grads else 4  # fp32 or bf16 images
        # the set's arenas too: a copy must not outlive the memory it writes (a pool dropped
        # before its copy ran, as a test may, was freed under the engine's memcpy)
        return (self.grad_base[table.slot] + table.start * item,
                live[table.slot] + table.start * item, table.numel * item, keep + [self.bufs])

    def pairs(self):
        slots, grads = self.job.plan.slots, self.grads
        return [(self.grad_pool.buffer(self.bufs, si, grads[si])[slots[si].host_slice(start, end)],
                 flat(grads[si], slots[si].dims)[start:end])
                for si, start, end in block_runs(self.table)]


def block_runs(table: BlockTable) -> List[Tuple[int, int, int]]:
    """``(slot, start, end)`` of the runs of ``table``'s blocks that follow one another in one
    slot: one tensor copy per run, not per block (found with array operations, so that the
    hooks' Python work grows with the tensors copied, not with their blocks)."""
    if not len(table):
        return []
    end = table.start + table.numel
    new = np.ones(len(table), dtype=bool)
    new[1:] = (table.slot[1:] != table.slot[:-1]) | (table.start[1:] != end[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(table)) - 1
    return list(zip(table.slot[first].tolist(), table.start[first].tolist(),
                    end[last].tolist()))


def _extents(table: BlockTable) -> Dict[int, Tuple[int, int]]:
    """Per slot of ``table``: the element range ``[lo, hi)`` its blocks span."""
    row = np.searchsorted(table.slots, table.slot)
    lo = np.full(len(table.slots), np.iinfo(np.int64).max)
    hi = np.zeros(len(table.slots), dtype=np.int64)
    np.minimum.at(lo, row, table.start)
    np.maximum.at(hi, row, table.start + table.numel)
    return dict(zip(table.slots.tolist(), zip(lo.tolist(), hi.tolist())))


def _bases(job: Job, table: BlockTable, grads, at: Optional[np.ndarray] = None):
    """Per slot: the address of the live gradient in the parameter's memory order (``at``
    where the caller has them: see :func:`live_gradients`); and the copies made of gradients
    laid out unlike their parameter."""
    if at is not None:
        return at, []
    plan, keep = job.plan, []
    live = np.zeros(len(plan.slots), dtype=np.int64)
    slots = table.slots.tolist()
    tensors = [grads[si] for si in slots]
    scan = _tensors.scan(tensors)
    ordered = in_memory_order(plan, slots, tensors, keep, scan[2])
    live[table.slots] = scan[0] if ordered is tensors else data_ptrs(ordered)
    return live, keep


def live_gradients(plan, slots: list) -> Tuple[Dict[int, torch.Tensor], Optional[np.ndarray]]:
    """Slot -> the ``.grad`` of each parameter of ``slots`` that has one, read with two C++
    passes (the step pre-hook's cost per tensor is kept to the reads it needs); and per slot
    of ``plan`` the address of its gradient (0: none), or None where some gradient is laid
    out unlike its parameter (:func:`_bases` reads them then); UnsupportedOptimizerError for
    a gradient the replay cannot use."""
    tensors = _tensors.grads(list(map(plan.params.__getitem__, slots)))
    if plan.dtensors:  # their local shards (FSDP2 reduce-scatters into them)
        tensors = [local_gradient(plan.slots[si], g) for si, g in zip(slots, tensors)]
    if has_none(tensors):  # not trained at this step: not stepped either
        slots = [si for si, g in zip(slots, tensors) if g is not None]
        tensors = [g for g in tensors if g is not None]
    addresses, _, flags = _tensors.scan(tensors)
    odd = np.flatnonzero((flags & _tensors.DENSE_FLOAT32) == 0)
    if len(odd):  # the replay modes: fp32 params
        si, g = slots[odd[0]], tensors[odd[0]]
        layout = "dense" if g.layout == torch.strided else str(g.layout).replace("torch.", "")
        raise UnsupportedOptimizerError(
            f"the gradient of {plan.slots[si].name!r} is a {layout} {g.dtype} tensor; the "
            "replay needs dense torch.float32 gradients (mode='async-o' copies at the step)")
    if not (plan.contiguous and np.all(flags & _tensors.CONTIGUOUS)):
        return dict(zip(slots, tensors)), None
    at = np.zeros(len(plan.slots), dtype=np.int64)
    at[slots] = addresses
    return dict(zip(slots, tensors)), at


def gradient_addresses(plan, slots: np.ndarray, params: list
                       ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """What :func:`live_gradients` finds where a copy needs only the gradients' addresses, read
    in one C++ pass without a Python object per gradient: the slots of ``slots`` (their
    parameters: ``params``) whose parameter has a gradient, and per slot of ``plan`` its
    address (0: none). None where :func:`live_gradients` must look (DTensors, tensor
    subclasses, a gradient that is not a contiguous dense float32 tensor: it raises or reads
    them its own way)."""
    if plan.dtensors:
        return None
    found = _tensors.grad_scan(params)
    if found is None or not plan.contiguous:
        return None
    addresses, flags, every, present = found
    if present and every != _USUAL_GRADIENT:
        return None
    if present < len(slots):  # some parameters were not trained at this step
        with_grad = flags != 0
        slots = slots[with_grad]
        addresses = addresses[with_grad]
    at = np.zeros(len(plan.slots), dtype=np.int64)
    at[slots] = addresses
    return slots, at


_USUAL_GRADIENT = _tensors.PRESENT | _tensors.CONTIGUOUS | _tensors.DENSE_FLOAT32


def local_gradient(slot, grad: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter's gradient, which must be laid out like the
    parameter (the same placements: the elements of the local parameter shard)."""
    if is_dtensor(grad) and grad.placements != slot.param.placements:
        raise UnsupportedOptimizerError(
            f"the gradient of {slot.name!r} has placements {grad.placements}, its parameter "
            f"{slot.param.placements}; the replay needs each rank's gradient shard to match its "
            "parameter shard (mode='async-o' copies at the step)")
    return local(grad)
