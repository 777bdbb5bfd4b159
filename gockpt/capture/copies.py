"""What the training-loop hooks hand to the transfer engine, and when it is valid.

Four kinds of capture feed one checkpoint:

    state groups   group j of blocks, queued at boundary N + j - 1: the version of the last update
    small state    everything small (buffers, scheduler, RNG, extra state), frozen at boundary F
    copies at F    slots the attached optimizer does not own, or found written outside it:
                   copied directly at the boundary of F, never replayed
    gradients      in the optimizer's step pre-hook: exactly what the update consumes, so that
                   the replay can bring every block captured before F up to version F
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Tuple

import numpy as np

import torch

from ..core.lists import has_none
from ..core.errors import ConfigError, ConsistencyError, HookOrderError, UnsupportedOptimizerError
from ..core.job import Job
from ..replay.adapters import AdamAdapter
from ..core.records import StepRecord
from ..storage import tree
from ..storage.manifest import SmallSection, small_prefix
from . import smallstate
from ..core.digest import LiveDigests, Ticket as DigestTicket
from ..core.plan import fingerprint, flat
from ..core.blocks import BlockTable
from ..core.staging import GradPool, HostCopy
from .transport import Bf16Transport
from .transfer import GRADIENT, STATE, CopyEngine


class Capture:
    """Copies of one model/optimizer pair into a job's host copy."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, engine: CopyEngine, adapter: Optional[AdamAdapter],
                 transport: Optional[Bf16Transport] = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.engine, self.adapter = engine, adapter
        self.transport = transport  # None: gradients cross in fp32
        self._zero_buf: Optional[torch.Tensor] = None
        self._snapshot = None  # (plan, the device-side gradient snapshot, its D2H ticket)
        self._last_states = None  # (plan, _dicts_of(optimizer.state), each slot's dict) at F

    def declare_state_keys(self, host: HostCopy) -> None:
        """Which optimizer state tensors this checkpoint carries, per slot (with a replay: the
        adapter's keys for every optimized slot, declared once)."""
        if self.adapter is not None and host.keys_declared:
            return
        likes = {}
        for si, s in enumerate(host.slots):
            if s.static:
                continue
            if self.adapter is not None:
                likes[si] = {k: s.param for k in self.adapter.state_keys}
            else:
                live = self.optimizer.state.get(s.param, {})
                likes[si] = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)
                             and k != "step" and v.shape == s.param.shape}
        host.set_keys(likes)

    def state_bytes(self, host: HostCopy) -> int:
        """Bytes of parameters and aligned state one checkpoint copies."""
        return host.nbytes()

    def enqueue_group(self, job: Job, j: int) -> None:
        """Queue the copies of group j: they hold the version of the last completed update.
        The versions of the tensors read are noted: a write during the copy (in forward or
        backward, e.g. nn.Embedding(max_norm=...)) is found at :meth:`land_group`."""
        book = job.capture
        table = book.table(j)
        book.tickets[j], book.reads[j] = self._copy(job, table, STATE)

    def copy_at_f(self, job: Job) -> list:
        """At the boundary of F: copy the blocks planned to be copied directly at F, now
        (before anything of the next step can write them); returns them."""
        table = job.plan.at_f_table()
        if len(table):
            ticket, _ = self._copy(job, table, GRADIENT)
            ticket.wait()
            job.capture.captured.extend(table.blocks)
            job.capture._tables["at_f"] = table
        return table.blocks

    def _copy(self, job: Job, table: BlockTable, priority: int):
        """Queue the copies of every tensor of ``table``'s blocks (the parameter and its
        aligned state; zeros where the optimizer has none yet): (ticket, the tensors read)."""
        if self.engine.device.asynchronous_copies:  # (the states checked at F: _states)
            return self.engine.submit(self._pairs(job, table.blocks, self._states(job)),
                                      priority), Reads([])
        roles = (None,) + job.host.roles()
        live, read, keep = self._live_bases(job, table.slots, roles)
        dst, src, size = [], [], []
        for key in roles:
            hbase, hitem = job.host.bases(key)
            rows = hbase[table.slot] != 0  # the blocks whose slot has this role
            if not rows.any():
                continue
            sub = table.slot[rows]
            offset = table.start[rows] * hitem[sub]
            nbytes = table.numel[rows] * hitem[sub]
            src_rows = live[key][sub] + offset
            missing = live[key][sub] == 0
            if missing.any():
                src_rows[missing] = self._zeros(int(nbytes[missing].max()))
                keep.append(self._zero_buf)  # a larger one may replace it before this lands
            dst.append(hbase[sub] + offset)
            src.append(src_rows)
            size.append(nbytes)
        if not dst:
            return self.engine.submit([], priority), read
        ticket = self.engine.submit_segments(np.concatenate(dst), np.concatenate(src),
                                             np.concatenate(size), priority)
        ticket._keep_alive = keep
        return ticket, read

    def _live_bases(self, job: Job, slots: np.ndarray, roles):
        """Per role (None: the parameter, or a state key), per slot: the address of the live
        tensor in the parameter's memory order (0 where the optimizer has no such state yet);
        the tensors read (a :class:`Reads`); and the copies made of tensors laid out unlike
        their parameter. A few list operations per role, not a Python step per tensor."""
        plan = job.plan
        n = len(plan.slots)
        states = self._states(job)
        sis, params = slots.tolist(), plan.params()
        slot_states = [states[si] for si in sis]
        bases, columns, copies = {}, [], []
        for key in roles:
            if key is None:
                have, tensors = sis, [params[si] for si in sis]
            else:
                tensors = [st.get(key) if st is not None else None for st in slot_states]
                have = sis
                if has_none(tensors):  # no such state yet
                    have = [si for si, t in zip(sis, tensors) if t is not None]
                    tensors = [t for t in tensors if t is not None]
            columns.append((have, tensors))
            base = bases[key] = np.zeros(n, dtype=np.int64)
            base[have] = [t.data_ptr() for t in _in_memory_order(plan, have, tensors, copies)]
        return bases, Reads(columns), copies

    def _states(self, job: Job) -> list:
        """Per slot: its optimizer state dict (None: none yet). Read once per checkpoint
        (``states_seen`` keeps what that reading saw, for the check at F); the slots without
        one are filled in when the optimizer has created states since, the others are never
        read again (a replaced one is found at F). Walked from ``optimizer.state``'s items by
        parameter id (looking each parameter up would call Tensor.__hash__, a Python
        function, per parameter)."""
        book, state = job.capture, self.optimizer.state
        if book.states is None and self._last_states is not None:
            plan, seen, states = self._last_states  # read at the last F
            if plan is job.plan and _same_dicts(state, seen):  # no dict replaced since
                book.states, book.states_seen = list(states), seen
                book.states_len = len(seen[1])
                book.missing_states = [si for si, st in enumerate(states) if st is None]
        if book.states is None:
            book.states, book.states_seen = self._read_states(job.plan), _dicts_of(state)
            book.states_len = len(state)
            book.missing_states = [si for si, st in enumerate(book.states) if st is None]
        elif book.missing_states and len(state) != book.states_len:  # states created since
            fresh, book.states_len = self._read_states(job.plan), len(state)
            for si in book.missing_states:
                book.states[si] = fresh[si]
            book.missing_states = [si for si in book.missing_states if fresh[si] is None]
        return book.states

    def _read_states(self, plan) -> list:
        """Per slot of ``plan``: the optimizer's state dict for its parameter now, or None."""
        index, states = plan.slot_of_id(), [None] * len(plan.slots)
        for p, st in self.optimizer.state.items():
            si = index.get(id(p))
            if si is not None:
                states[si] = st
        return states

    def replaced_states(self, job: Job) -> list:
        """At F: the slots whose optimizer state, as this checkpoint's copies read it, has been
        replaced since (optimizer.load_state_dict(), a state dict assigned): the checkpoint
        would hold another state than the live one. When ``optimizer.state`` still holds the
        very dicts it held then (one C-level identity pass), none was."""
        cached, state = self._states(job), self.optimizer.state
        if _same_dicts(state, job.capture.states_seen):
            now, replaced = cached, []
        else:
            now = self._read_states(job.plan)
            reloaded = state is not job.capture.states_seen[0]  # load_state_dict: every slot
            replaced = [s.name for s, old, new in zip(job.plan.slots, cached, now)
                        if new is not old and (old is not None or reloaded)]
        # The next checkpoint starts from this reading if no state dict has been replaced
        # by then (the same identity pass), else it reads them again.
        self._last_states = (job.plan, _dicts_of(state), now)
        return replaced

    def _zeros(self, nbytes: int) -> int:
        """Address of at least ``nbytes`` zero bytes (the source of state not created yet)."""
        if self._zero_buf is None or self._zero_buf.numel() < nbytes:
            self._zero_buf = torch.zeros(max(nbytes, 1 << 16), dtype=torch.uint8)
        return self._zero_buf.data_ptr()

    def digest_live(self, job: Job, digester: LiveDigests) -> None:
        """At the boundary of F, after the small state is frozen: queue the digests
        (:mod:`gockpt.core.digest`) of every tensor this checkpoint stores -- each
        parameter and each aligned optimizer state tensor, read through torch as the
        framework presents them, not by the addresses the copies use -- to be compared with
        the staged host copy before anything is committed. The slots copied at F (written
        in place during forward/backward, or not optimized) are digested now, before the
        next step can write them; the others under the next forward/backward, waited for
        before the next update (:meth:`LiveDigestBook.wait_before_update`)."""
        plan, host = job.plan, job.host
        states = self._states(job)
        entries: List[Tuple[int, Optional[str]]] = []
        tensors: List[torch.Tensor] = []
        for si, slot in enumerate(plan.slots):
            entries.append((si, None))
            tensors.append(slot.param)
            st = states[si]
            if st is not None and not slot.static:
                for key in host.keys[si]:
                    if key in st:
                        entries.append((si, key))
                        tensors.append(st[key])
        at_f = [i for i, (si, _) in enumerate(entries) if plan.slots[si].at_f]
        later = [i for i, (si, _) in enumerate(entries) if not plan.slots[si].at_f]
        book = LiveDigestBook(entries, Reads([([si for si, _ in entries], tensors)]))
        for part in (at_f, later):
            if part:
                book.parts.append((part, digester.submit([tensors[i] for i in part])))
        if at_f:  # their copies are taken at F: read them before anything can change them
            self.engine.device.order_after_digests(book.parts[0][1])
        job.capture.live_digests = book

    def _pairs(self, job: Job, blocks, states: list) -> list:
        """(host destination, live source) of every tensor of ``blocks`` (for a device whose
        copies are enqueued tensor by tensor); ``states``: per slot, its optimizer state."""
        host, plan = job.host, job.plan
        pairs = []
        for b in blocks:
            slot = plan.slots[b.slot]
            s, e = b.start, b.end
            pairs.append((host.param[b.slot][s:e], flat(slot.param, slot.dims)[s:e]))
            live = states[b.slot] or {}
            for key in host.keys[b.slot]:
                dst = host.state[b.slot][key][s:e]
                if key in live:
                    pairs.append((dst, flat(live[key], slot.dims)[s:e]))
                else:
                    dst.zero_()  # no state yet: the replayed first update starts from zeros
        return pairs

    def land_group(self, job: Job, j: int) -> None:
        """update_begin of window step j: group j's copies must have landed (they hold the
        version before this step's update), and nothing may have written what they read
        meanwhile (ConsistencyError naming the tensors otherwise)."""
        book = job.capture
        ticket = book.tickets.get(j)
        if ticket is None:
            return
        ticket.wait()
        written = book.reads[j].written() if j in book.reads else set()
        written = sorted({job.plan.slots[si].name for si in written})
        if written:
            book.written_outside.update(written)
            raise ConsistencyError(
                f"{', '.join(written[:5])} {'was' if len(written) == 1 else 'were'} written "
                f"during the training step in which gockpt copied {'it' if len(written) == 1 else 'them'}"
                " (an in-place write outside the optimizer, e.g. nn.Embedding(max_norm=...)); "
                "the checkpoint is not committed and these tensors are copied at the step "
                "boundary from now on")
        book.captured.extend(book.groups[j - 1])
        book.landed.append(j)

    def copy_rest(self, job: Job) -> None:
        """Copy every block not yet captured now, blocking (sync/async, or close())."""
        book = job.capture
        for j in range(1, job.k + 1):
            if j not in book.tickets:
                self.enqueue_group(job, j)
        for j in range(1, job.k + 1):
            book.tickets[j].wait()
        book.captured = [b for g in book.groups for b in g]
        book.landed = list(range(1, job.k + 1))
        book._tables.pop("at_f", None)
        job.captured()

    def freeze_small(self, job: Job, step: int, extra_state) -> None:
        """Encode everything small at the boundary of F (tensors apart, no pickle)."""
        if callable(extra_state):
            extra_state = extra_state()
        plan = job.plan
        states = self._states(job)  # checked at F by replaced_states()
        with_state = [(si, index) for si, index in plan.optimized() if states[si] is not None]
        known = [(index, states[si]) for si, index in with_state]
        keys = job.host.keys
        aligned = {index: keys[si] for si, index in with_state}
        job.capture.aligned = aligned
        # The plan's indices hold while the optimizer's parameters are the planned ones (a
        # parameter added after the last step pre-hook of the window: ask state_dict())
        indices = plan.group_indices() if fingerprint(self.optimizer) == plan.fingerprint \
            else None
        tensors: Dict[str, torch.Tensor] = {}
        values = {
            "model": smallstate.model_small(self.model, plan.slot_of_id()),
            "optimizer": smallstate.optimizer_small(
                self.optimizer, aligned, (known, indices) if indices is not None else None),
            "scheduler": smallstate.scheduler_state(self.scheduler),
            "rng": smallstate.capture_rng(),
            "extra_state": extra_state,
        }
        try:
            small = SmallSection(**{section: tree.encode(value, tensors, small_prefix(section),
                                                         inline_scalars=True)
                                    for section, value in values.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot store the state of step {step}: {exc}") from exc
        job.capture.small, job.capture.small_tensors = small, tensors

    def gradients(self, job: Job, j: int, groups, grad_pool: GradPool,
                  snapshot: bool = False) -> Optional[StepRecord]:
        """Queue the copies of this step's gradients for the blocks captured so far of the
        planned param groups ``groups`` (the optimizer's ``param_groups`` now, in order: all
        of them, or the one DeepSpeed's ZeRO steps at a time); the record to replay, or None
        when GradScaler skips the step (nothing changes).

        With ``snapshot`` the gradients are first copied on the device (at device memory
        speed, before the update may start) and the slow device-to-host copy reads that
        snapshot: nothing the loop does to ``.grad`` afterwards can reach it (gockpt-o)."""
        if self.adapter.skipped_by_scaler():
            return None
        why = self.adapter.unsupported_step()
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
        grads = _live_gradients(plan, table.slots[plan.in_groups(groups)[table.slots]].tolist())
        steps = self.adapter.step_counts(grads, self._states(job))
        table = table.where(np.isin(table.slot, np.fromiter(grads, np.int64, len(grads))))
        # bf16: images made on the device now, so the copy reads them and not .grad (a
        # snapshot); fp32 when the transport is off or this step's images are not exact
        encoded = self.transport.encode({si: grads[si] for si in table.slots.tolist()}) \
            if self.transport is not None else None
        dtype, mul = (torch.bfloat16, encoded[1]) if encoded else (torch.float32, 1.0)
        bufs = grad_pool.acquire()
        grad_base = grad_pool.arena(bufs, dtype).bases(len(plan.slots))
        snapshot = encoded is not None or (snapshot and not self.engine.device.asynchronous_copies)
        if encoded is not None:
            ticket = self._copy_gradients(job, table, encoded[0], bufs, grad_pool, grad_base)
            ticket._keep_alive = (getattr(ticket, "_keep_alive", None), encoded[0])  # read
        elif snapshot:
            ticket = self._snapshot_gradients(job, table, grads, grad_base)
        else:
            ticket = self._copy_gradients(job, table, grads, bufs, grad_pool, grad_base)
        scalars = {groups[i]: sc for i, sc in self.adapter.scalars().items()}
        record = StepRecord(j, scalars, steps, table, bufs, grad_base, ticket,
                            lambda bufs=bufs: grad_pool.release(bufs), ticket.nbytes,
                            final=j == job.k - 1, snapshot=snapshot, grad_dtype=dtype,
                            grad_mul=mul)
        job.metrics.add_grad_step(self.transport.name if encoded else "fp32", ticket.nbytes,
                                  new_step)
        job.capture.grad_tickets.append(ticket)
        return record

    def _snapshot_gradients(self, job: Job, table: BlockTable, grads, grad_base: np.ndarray):
        """Copy the gradients of ``table``'s blocks to the device-side snapshot now, then queue
        the device-to-host copy from it (the snapshot is reused once that copy has landed)."""
        device, plan = self.engine.device, job.plan
        if self._snapshot is None or self._snapshot[0] is not plan:
            sizes = {si: s.numel for si, s in enumerate(plan.slots) if not s.static}
            self._snapshot = (plan, device.device_arena(torch.float32, sizes), None)
        _, arena, previous = self._snapshot
        if previous is not None:  # its copy still reads the snapshot
            device.order_after(previous)
        live, keep = self._grad_bases(job, table, grads)
        snap = arena.bases(len(plan.slots))
        offset, nbytes = table.start * 4, table.numel * 4  # float32 (the replay modes)
        device.copy_now(snap[table.slot] + offset, live[table.slot] + offset, nbytes)
        ticket = self.engine.submit_segments(grad_base[table.slot] + offset,
                                             snap[table.slot] + offset, nbytes, GRADIENT)
        self._snapshot = (plan, arena, ticket)
        return ticket

    def _grad_bases(self, job: Job, table: BlockTable, grads):
        """Per slot: the address of the live gradient in the parameter's memory order; and
        the copies made of gradients laid out unlike their parameter."""
        plan, keep = job.plan, []
        live = np.zeros(len(plan.slots), dtype=np.int64)
        slots = table.slots.tolist()
        tensors = _in_memory_order(plan, slots, [grads[si] for si in slots], keep)
        live[table.slots] = [g.data_ptr() for g in tensors]
        return live, keep

    def _copy_gradients(self, job: Job, table: BlockTable, grads, bufs, grad_pool: GradPool,
                        grad_base: np.ndarray):
        """Queue the copies of ``grads`` (slot -> live gradient) for ``table``'s blocks into
        the gradient set ``bufs``, in the parameters' memory order."""
        plan = job.plan
        live, keep = self._grad_bases(job, table, grads)
        if self.engine.device.asynchronous_copies:
            pairs = [(grad_pool.buffer(bufs, b.slot, grads[b.slot])[b.start:b.end],
                      flat(grads[b.slot], plan.slots[b.slot].dims)[b.start:b.end])
                     for b in table.blocks]
            return self.engine.submit(pairs, GRADIENT)
        item = next(iter(grads.values())).element_size() if grads else 4  # fp32 or bf16 images
        ticket = self.engine.submit_segments(grad_base[table.slot] + table.start * item,
                                             live[table.slot] + table.start * item,
                                             table.numel * item, GRADIENT)
        ticket._keep_alive = keep
        return ticket


def _in_memory_order(plan, slots: list, tensors: list, keep: list) -> list:
    """``tensors`` (one per slot of ``slots``) each laid out as its parameter was planned: the
    tensor itself, or (rare: a state tensor or gradient with other strides) a flat copy in the
    parameter's memory order, also appended to ``keep`` (alive until its copy has run)."""
    planned = plan.strides()
    if [t.stride() for t in tensors] == [planned[si] for si in slots]:
        return tensors
    out = list(tensors)
    for i, si in enumerate(slots):
        if out[i].stride() != planned[si]:
            out[i] = flat(out[i], plan.slots[si].dims)
            keep.append(out[i])
    return out


def _dicts_of(state: dict) -> tuple:
    """(``state``, the dicts it holds, in order): what :func:`_same_dicts` compares with."""
    return state, list(state.values())


def _same_dicts(state: dict, seen: tuple) -> bool:
    """Whether ``state`` is the mapping of ``seen`` (:func:`_dicts_of`) and holds the very same
    dicts in the same order (by identity, in one C-level pass)."""
    mapping, values = seen
    return mapping is state and len(state) == len(values) and \
        all(map(operator.is_, state.values(), values))


class LiveDigestBook:
    """The digests of the live tensors at F of one checkpoint: ``entries`` (slot, None for
    the parameter or a state key) in order, ``parts``: (entry positions, their digest
    ticket), and the tensors as :class:`Reads` (an in-place write since F tells a torn read
    from a wrong copy)."""

    def __init__(self, entries: List[Tuple[int, Optional[str]]], reads: "Reads"):
        self.entries, self.reads = entries, reads
        self.parts: List[Tuple[List[int], DigestTicket]] = []
        self._written: Optional[set] = None  # taken before the next update

    def tickets(self) -> List[DigestTicket]:
        return [t for _, t in self.parts]

    def wait_before_update(self, device) -> None:
        """The next optimizer update must not run before the digests have read the tensors;
        what was written in place until now is noted (the update itself writes them too)."""
        for ticket in self.tickets():
            device.order_after_digests(ticket)
        self._written = self.reads.written()

    def pairs(self) -> List[Tuple[int, int]]:
        """Every entry's digest, in entry order (waits for them)."""
        out: List = [None] * len(self.entries)
        for positions, ticket in self.parts:
            for i, pair in zip(positions, ticket.pairs()):
                out[i] = pair
        return out

    def written(self) -> set:
        """The slots of the tensors written in place after F while the digests read them
        (until the next update: from then on the optimizer writes them)."""
        return self._written if self._written is not None else self.reads.written()

    def seconds(self) -> float:
        return sum(t.seconds for t in self.tickets())


class Reads:
    """The live tensors some queued copies (or digests) read, role by role as
    ``columns = [(slot indices, tensors), ...]``, with their versions when queued: an
    in-place write since then (outside the optimizer) is found by :meth:`written`."""

    def __init__(self, columns: list):
        self.columns = columns
        self.versions = [[t._version for t in tensors] for _, tensors in columns]

    def written(self) -> set:
        """The slots of the tensors written since they were queued."""
        out = set()
        for (slots, tensors), before in zip(self.columns, self.versions):
            now = [t._version for t in tensors]
            if now != before:
                out.update(si for si, a, b in zip(slots, now, before) if a != b)
        return out


def _live_gradients(plan, slots: list) -> Dict[int, torch.Tensor]:
    """Slot -> the ``.grad`` of each parameter of ``slots`` that has one, read with a few
    list operations (the step pre-hook's cost per tensor is kept to the reads it needs);
    UnsupportedOptimizerError for a gradient the replay cannot use."""
    params = plan.params()
    tensors = [params[si].grad for si in slots]
    if has_none(tensors):  # not trained at this step: not stepped either
        slots = [si for si, g in zip(slots, tensors) if g is not None]
        tensors = [g for g in tensors if g is not None]
    if {(g.dtype, g.layout) for g in tensors} - {(torch.float32, torch.strided)}:
        si, g = next((si, g) for si, g in zip(slots, tensors) if g.dtype != torch.float32
                     or g.layout != torch.strided)  # the replay modes: fp32 params
        layout = "dense" if g.layout == torch.strided else str(g.layout).replace("torch.", "")
        raise UnsupportedOptimizerError(
            f"the gradient of {plan.slots[si].name!r} is a {layout} {g.dtype} tensor; the "
            "replay needs dense torch.float32 gradients (mode='async-o' copies at the step)")
    return dict(zip(slots, tensors))
