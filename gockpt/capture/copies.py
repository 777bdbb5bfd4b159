"""What the training-loop hooks hand to the transfer engine, and when it is valid (the
addresses in :mod:`.addresses`, the optimizer's state dicts in :mod:`.states`, the gradients
in :mod:`.gradients`).

Four kinds of capture feed one checkpoint:

    state groups   group j of blocks, queued at boundary N + j - 1: the version of the last update
    small state    everything small (buffers, scheduler, RNG, extra state), frozen at boundary F
    copies at F    slots the attached optimizer does not own, or found written outside it:
                   copied directly at the boundary of F, never replayed
    gradients      in the optimizer's step pre-hook: exactly what the update consumes, so that
                   the replay can bring every block captured before F up to version F
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from .. import _tensors
from ..core.blocks import BlockTable
from ..core.digest import LiveDigests, Ticket as DigestTicket
from ..core.errors import Adaptation, ConsistencyError
from ..core.job import Job
from ..core.optstate import KnownStates, optimizer_small
from ..core.memory import flat, local
from ..core.planning import check_layouts, same_params
from ..core.protocols import ReplayAdapter
from ..core.records import StepRecord
from ..core.staging import GradPool, HostCopy
from . import smallstate
from .addresses import NO_SEGMENTS, Reads, SegmentLayout, Zeros, group_sources, live_bases
from .gradients import GradientCopies, block_runs
from .states import StateWatch
from .transfer import GRADIENT, STATE, CopyEngine
from .transport import Bf16Transport


class Capture:
    """Copies of one model/optimizer pair into a job's host copy."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, engine: CopyEngine, adapter: Optional[ReplayAdapter],
                 transport: Optional[Bf16Transport] = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.engine, self.adapter = engine, adapter
        self.states = StateWatch(optimizer)
        self.grads = GradientCopies(engine, self.states, transport)
        self._zeros = Zeros()
        self._known = None  # what _known_states() read at the last F, and its result
        self._layouts = None  # (plan, host, its keys_version, {tables: SegmentLayout})
        self._walks = _tensors.ModuleWalkCache()  # the model's small state, walked at F

    def declare_state_keys(self, host: HostCopy) -> None:
        """Which optimizer state tensors this checkpoint carries, per slot (with a replay: the
        adapter's keys for every optimized slot, declared once)."""
        self.states.declare_keys(host, self.adapter.state_keys if self.adapter else None)

    def replaced_states(self, job: Job) -> list:
        """At F: the slots whose optimizer state was replaced since the copies read it."""
        return self.states.replaced(job)

    def gradients(self, job: Job, j: int, groups, grad_pool: GradPool,
                  snapshot: bool = False) -> Optional[StepRecord]:
        """The record of this step's gradients for the replay (:mod:`.gradients`)."""
        return self.grads.record(job, j, groups, grad_pool, self.adapter, snapshot)

    def check_layouts(self, plan) -> None:
        """At a checkpoint's start: LayoutChangedError where a parameter's strides are not
        those planned -- unless this plan's copies check each parameter as they read it (a
        device that copies segments, a contiguous plan without DTensors: the sources read by
        :func:`.addresses.group_sources`), one pass over every parameter fewer."""
        if not (self.engine.device.copies_segments and plan.contiguous and not plan.dtensors):
            check_layouts(plan)

    def state_bytes(self, host: HostCopy) -> int:
        """Bytes of parameters and aligned state one checkpoint copies."""
        return host.nbytes()

    def enqueue_group(self, job: Job, j: int) -> None:
        """Queue the copies of group j: they hold the version of the last completed update.
        The versions of the tensors read are noted: a write during the copy (in forward or
        backward, e.g. nn.Embedding(max_norm=...)) is found at :meth:`land_group`."""
        book = job.capture
        table = book.table(j)
        params = job.plan.group_param_tables(job.k)[j - 1]  # (the slots' copied at F: last)
        book.tickets[j], book.reads[j] = self._copy(job, table, STATE, params)

    def copy_at_f(self, job: Job) -> list:
        """At the boundary of F: copy the blocks planned to be copied directly at F, now
        (before anything of the next step can write them); returns them."""
        table = job.plan.at_f_table
        if len(table):
            ticket, _ = self._copy(job, table, GRADIENT)
            ticket.wait()
            job.capture.parts.append(table.blocks)
            job.capture.at_f_table = table
        return table.blocks

    def _copy(self, job: Job, table: BlockTable, priority: int,
              params: Optional[BlockTable] = None):
        """Queue the copies of every tensor of ``table``'s blocks (the parameter and its
        aligned state; zeros where the optimizer has none yet), the parameters of ``params``'
        blocks instead where given: (ticket, the tensors read)."""
        group = _StateCopies(self, job, table, self.states.of(job),
                             table if params is None else params)  # (checked at F)
        ticket = self.engine.submit_group(group, priority)
        return ticket, group.reads

    def segments_of(self, job: Job, table: BlockTable, states: list,
                    params: Optional[BlockTable] = None):
        """The copies of ``table``'s blocks as host memcpy segments (their parameters: those of
        ``params``' blocks, default ``table``), in the planned memory order of each role:
        (dst, src, nbytes, keep, the tensors read). Where each block goes, and from which
        element, is worked out once per table (:class:`.addresses.SegmentLayout`); here only
        the live tensors are read."""
        layout = self._segment_layout(job, table, table if params is None else params)
        keep: list = []
        found = group_sources(job.plan, states, layout.roles, self.states.lookup)  # (usual)
        if found is not None:
            src, columns, absent = found
        else:  # role by role (DTensors, or tensors laid out unlike their parameter)
            srcs, columns = [], []
            for role in layout.roles:
                live, read = live_bases(job.plan, states, role.slots, role.key, keep)
                columns.append(read)
                at = live[role.at]
                srcs.append(np.where(at != 0, at + role.offset, 0))
            if not srcs:
                return NO_SEGMENTS + ([], Reads([]))
            src = np.concatenate(srcs)
            absent = int(np.count_nonzero(src == 0))
        if absent:  # no such state yet (address 0): zeros are copied
            missing = src == 0
            src[missing] = self._zeros.address(int(layout.nbytes[missing].max()))
            keep.append(self._zeros.buffer)
        return layout.dst, src, layout.nbytes, keep, Reads(columns)

    def _segment_layout(self, job: Job, table: BlockTable, params: BlockTable
                        ) -> "SegmentLayout":
        """:class:`.addresses.SegmentLayout` of ``table`` / ``params`` in ``job``'s host
        copy, kept while the plan and the host copy's arenas are the same (a few tables per
        plan)."""
        host = job.host
        seen = self._layouts
        if seen is None or seen[0] is not job.plan or seen[1] is not host or \
                seen[2] != host.keys_version:
            seen = self._layouts = (job.plan, host, host.keys_version, {})
        key = (id(table), id(params))
        found = seen[3].get(key)
        if found is None or found[0] is not table or found[1] is not params:
            found = seen[3][key] = (table, params,
                                    SegmentLayout(host, table, params, (None,) + host.roles()))
        return found[2]

    def digest_live(self, job: Job, digester: LiveDigests) -> None:
        """At the boundary of F, after the small state is frozen: queue the digests
        (:mod:`gockpt.core.digest`) of every tensor this checkpoint stores -- each
        parameter and each aligned optimizer state tensor, read through torch as the
        framework presents them, not by the addresses the copies use -- to be compared with
        the staged host copy before anything is committed. The slots copied at the boundary
        of F (written in place during forward/backward, or not optimized) are digested now,
        before the next step can write them; the others (``step_written`` slots too) under
        the next forward/backward, waited for before the next update
        (:meth:`LiveDigestBook.wait_before_update`)."""
        plan, host = job.plan, job.host
        states = self.states.of(job)
        entries: List[Tuple[int, Optional[str]]] = []
        tensors: List[torch.Tensor] = []
        for si, slot in enumerate(plan.slots):
            if not slot.here:  # other replicas store it
                continue
            entries.append((si, None))
            tensors.append(slot.held_view(slot.local))
            st = states[si]
            if st is not None and not slot.static:
                for key in host.keys[si]:
                    if key in st:
                        entries.append((si, key))
                        tensors.append(slot.held_view(local(st[key])))
        now = [s.at_f and not s.step_written for s in plan.slots]  # copied at the boundary
        at_f = [i for i, (si, _) in enumerate(entries) if now[si]]
        later = [i for i, (si, _) in enumerate(entries) if not now[si]]
        book = LiveDigestBook(entries, Reads([([si for si, _ in entries], tensors)]))
        for part in (at_f, later):
            if part:
                book.parts.append((part, digester.submit([tensors[i] for i in part])))
        if at_f:  # their copies are taken at F: read them before anything can change them
            self.engine.device.order_after_digests(book.parts[0][1])
        job.capture.live_digests = book

    def pairs_of(self, job: Job, table: BlockTable, states: list,
                 params: Optional[BlockTable] = None) -> list:
        """(host destination, live source) of every tensor of ``table``'s blocks (their
        parameters: those of ``params``' blocks, default ``table``), a pair per run of
        consecutive blocks (for a device whose copies are enqueued tensor by tensor);
        ``states``: per slot, its optimizer state."""
        host, plan = job.host, job.plan
        pairs = []
        for si, s, e in block_runs(table if params is None else params):
            slot = plan.slots[si]
            pairs.append((host.param[si][slot.host_slice(s, e)],
                          flat(slot.local, slot.dims)[s:e]))
        for si, s, e in block_runs(table):
            slot = plan.slots[si]
            live = states[si] or {}
            for key in host.keys[si]:
                dst = host.state[si][key][slot.host_slice(s, e)]
                if key in live:
                    pairs.append((dst, flat(local(live[key]), slot.dims)[s:e]))
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
        written = book.reads[j].written() if j in book.reads else ()
        if written:
            written = sorted({job.plan.slots[si].name for si in written})
            raise ConsistencyError(
                f"{', '.join(written[:5])} {'was' if len(written) == 1 else 'were'} written "
                f"during the training step in which gockpt copied {'it' if len(written) == 1 else 'them'}"
                " (an in-place write outside the optimizer, e.g. nn.Embedding(max_norm=...), "
                "or moved to other memory: p.data = ...); "
                "the checkpoint is not committed and these tensors are copied at the step "
                "boundary from now on", adapt=Adaptation.COPY_AT_F, tensors=written)
        book.parts.append(book.groups[j - 1])
        book.landed.append(j)

    def copy_rest(self, job: Job) -> None:
        """Copy every block not yet captured now, blocking (sync/async, or close())."""
        book = job.capture
        for j in range(1, job.k + 1):
            if j not in book.tickets:
                self.enqueue_group(job, j)
        for j in range(1, job.k + 1):
            book.tickets[j].wait()
        book.parts = list(book.groups)
        book.landed = list(range(1, job.k + 1))
        book.at_f_table = None
        job.captured()

    def small_state(self, job: Job, extra_state
                    ) -> Tuple[Dict[str, object], Dict[int, tuple], Set[int]]:
        """At the boundary of F: everything small, as Python values (the caller encodes them
        at once, before anything can change them), the aligned state keys of each optimizer
        state index (what the blocks carry of the optimizer state), and the id()s of the
        tensors and arrays made here, held nowhere else (stored without another copy)."""
        if callable(extra_state):
            extra_state = extra_state()
        plan = job.plan
        known, aligned = self._known_states(job)
        # The plan's indices hold while the optimizer's parameters are the planned ones (a
        # parameter added after the last step pre-hook of the window: ask state_dict())
        if not same_params(self.optimizer, plan.fingerprint) or plan.group_indices is None:
            known = None
        values = {
            "model": smallstate.model_small(self.model, plan.slot_of_id, self._walks),
            "optimizer": optimizer_small(self.optimizer, aligned, known),
            "scheduler": smallstate.scheduler_state(self.scheduler),
            "rng": smallstate.capture_rng(),
            "extra_state": extra_state,
        }
        return values, aligned, smallstate.fresh_ids(values["rng"], values["optimizer"])

    def _known_states(self, job: Job) -> Tuple[KnownStates, Dict[int, tuple]]:
        """The optimizer state of ``job``'s optimized slots as :func:`optimizer_small` takes it,
        and the aligned keys of each state index (shared by the checkpoints that find the same:
        never changed once built). Built again only when some slot's state dict may not be
        the one of the last F (:attr:`StateWatch.generation`: created or replaced since), or
        the aligned keys were declared anew."""
        states = self.states.of(job)  # checked at F by replaced_states()
        plan, host = job.plan, job.host
        if self._known is not None:
            seen, version, generation, out = self._known
            if seen[0] is plan and seen[1] is host and version == host.keys_version and \
                    generation == self.states.generation:
                return out  # (no pass over the slots)
        with_state = [(si, index) for si, index in plan.optimized if states[si] is not None]
        aligned = {index: host.keys[si] for si, index in with_state}
        first = next(iter(aligned.values()), None)
        known = KnownStates([index for _, index in with_state],
                            [states[si] for si, _ in with_state], plan.group_indices,
                            first if all(k == first for k in aligned.values()) else None)
        self._known = ((plan, host), host.keys_version, self.states.generation, (known, aligned))
        return known, aligned


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


class _StateCopies:
    """The copies of a table's blocks, in the form the device takes them
    (``device.CopyGroup``): memcpy segments or tensor pairs; either way the live tensors they
    read are watched for in-place writes until they land (:attr:`reads`)."""

    def __init__(self, capture: Capture, job: Job, table: BlockTable, states: list,
                 params: BlockTable):
        self.capture, self.job, self.table, self.states = capture, job, table, states
        self.params = params  # the blocks whose parameter is copied
        self.reads = Reads([])

    def segments(self):
        *segments, self.reads = self.capture.segments_of(self.job, self.table, self.states,
                                                         self.params)
        return tuple(segments)

    def pairs(self):
        pairs = self.capture.pairs_of(self.job, self.table, self.states, self.params)
        # An enqueued copy reads its source when the device runs it: a write in the step
        # (nn.Embedding(max_norm=...) in forward) tears it as surely as a host memcpy's --
        # found at land_group, before F, as there (unwatched, only the digests at F saw it,
        # too late to take that step again, and nothing did with verify=False).
        slots, tensors = [], []
        for si in self.params.slots.tolist():
            slots.append(si)
            tensors.append(self.job.plan.slots[si].local)
        for si in self.table.slots.tolist():
            live = self.states[si] or {}
            for key in self.job.host.keys[si]:
                if key in live:
                    slots.append(si)
                    tensors.append(local(live[key]))
        self.reads = Reads([(slots, tensors)])
        return pairs
