"""Which tensors a checkpoint holds, cut into which blocks, copied at which step.

A *slot* is one parameter with its aligned optimizer state (master weights, exp_avg,
exp_avg_sq, and the gradient used by the replay); a *block* is a contiguous element range of a
slot, the same range in every one of those tensors, so that they travel and replay together.
Parameters that the attached optimizer does not update (frozen, or trained by another
optimizer) are *static* slots. Static slots, and slots found written outside the optimizer,
are copied directly at the boundary of F (``at_f``) -- but the static slots that only the
training's step writes (``step_written``: DeepSpeed's module weights) ride with the last
group, under the next forward/backward; the others are spread over the window's groups and
replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .blocks import Block, BlockTable
from .errors import ConfigError
from .memory import flat, global_slice, local, logical


@dataclass
class Slot:
    """One model parameter in the checkpoint."""

    name: str                      # name in model.state_dict(), without wrapper prefixes
    param: torch.Tensor = field(repr=False)  # as the optimizer holds it (a DTensor: `local`)
    opt_index: Optional[int]       # index in optimizer.state_dict()['state'], None if static
    group: Optional[int]           # optimizer param group, None if static
    dims: Tuple[int, ...] = ()     # memory order: param.permute(dims) is contiguous
    strides: Tuple[int, ...] = ()  # the strides planned for (a change is refused)
    at_f: bool = False             # copied directly at the boundary of F, never replayed
    param_at_f: bool = False       # its parameter copied at F (the replay does not reproduce
    #                                its update), its moments replayed over the window
    step_written: bool = False     # static, written only by the training's step: copied with
    #                                the last group (at version F, under the next forward/
    #                                backward), not at the boundary
    extent: Tuple[int, int] = (0, -1)  # elements [lo, hi) in memory order this rank holds
    replicated: bool = True        # the same on every replica: split among them when the ranks
    #                                take shares (False: this rank's own, kept whole)
    replicas: Optional[Tuple[int, ...]] = None  # the ranks holding it alike (None: every
    #                                rank); a DTensor's are the ranks of its mesh's Replicate dims

    def __post_init__(self):
        self.strides = tuple(self.local.stride())
        self.at_f = self.at_f or self.opt_index is None
        if self.extent[1] < 0:
            self.extent = (0, self.local.numel())
        # a DTensor's (global shape, offsets of its local shard); None for a plain tensor
        self.global_slice = global_slice(self.param)

    @property
    def local(self) -> torch.Tensor:
        """The tensor whose memory holds what this rank checkpoints of the parameter: the
        parameter, or a DTensor's local shard (what every stage copies, replays, stores)."""
        return local(self.param)

    @property
    def held(self) -> int:
        """How many of its elements this rank holds (copies, replays and writes)."""
        return self.extent[1] - self.extent[0]

    @property
    def here(self) -> bool:
        """Whether this rank stores it: all of it (even empty), or a share of its elements."""
        return self.held > 0 or self.whole

    @property
    def whole(self) -> bool:
        """Whether this rank holds every element."""
        return self.extent == (0, self.local.numel())

    def host_slice(self, start: int, end: int) -> slice:
        """Where its elements [start, end) lie in a host buffer holding the extent."""
        return slice(start - self.extent[0], end - self.extent[0])

    def held_view(self, t: torch.Tensor) -> torch.Tensor:
        """What this rank holds of ``t`` (its parameter or an aligned state tensor): ``t`` when
        whole, else the extent's elements in memory order, flat."""
        return t if self.whole else flat(t, self.dims)[slice(*self.extent)]

    def staged_view(self, staged: torch.Tensor) -> torch.Tensor:
        """A staged host copy of the extent as :meth:`held_view` presents the live tensor (the
        same bytes in the same order: their digests compare)."""
        return logical(tuple(self.local.shape), self.dims, staged) if self.whole else staged

    @property
    def stored_shape(self) -> Tuple[int, ...]:
        """The shape stored: the parameter's, permuted into memory order."""
        shape = tuple(self.local.shape)
        return tuple(shape[d] for d in self.dims) if self.dims else shape

    @property
    def numel(self) -> int:
        return self.local.numel()

    @property
    def static(self) -> bool:
        return self.opt_index is None


@dataclass
class Plan:
    slots: List[Slot]
    blocks: List[Block]
    aliases: Dict[str, str]  # extra state_dict names of tied parameters -> canonical name
    fingerprint: tuple = ()  # the optimizer's parameters when planned (see fingerprint())
    block_elems: int = 1     # elements per block (the last block of a slot is shorter)
    share: Tuple[int, int] = (0, 1)  # (r, n): this rank holds share r of n (take_share)
    k_cap: int = 0  # with shares: the fewest blocks any share replays (a K all can fill)
    # Derived once and kept: the slots never change (a change of parameters makes a new
    # plan) -- except which are copied at F, and what depends on that (the blocks copied at
    # F, the capture groups per K) is dropped explicitly by copy_at_f.
    _at_f_table: Optional[BlockTable] = field(default=None, repr=False)
    _windows: Dict[int, tuple] = field(default_factory=dict, repr=False)  # K -> groups, tables
    _in_groups: Dict[tuple, "np.ndarray"] = field(default_factory=dict, repr=False)

    def blocks_at_f(self) -> List[Block]:
        """The blocks copied directly at the boundary of F."""
        return self.at_f_table.blocks

    @property
    def at_f_table(self) -> BlockTable:
        """:meth:`blocks_at_f` as a BlockTable (built once, until copy_at_f changes it)."""
        if self._at_f_table is None:
            self._at_f_table = BlockTable([b for b in self.blocks if self.slots[b.slot].at_f
                                           and not self.slots[b.slot].step_written])
        return self._at_f_table

    def mark_step_written(self, names) -> None:
        """``Config.step_written``: these static slots ride with the last group (ConfigError
        for a name that is no parameter, or one the optimizer updates)."""
        names = set(names or ())
        known = {s.name: s for s in self.slots}
        for name in sorted(names):
            if name not in known:
                raise ConfigError(f"step_written names {name!r}, which is not a parameter of "
                                  f"the model (known: {', '.join(sorted(known)[:5])}, ...)")
            if not known[name].static:
                raise ConfigError(f"step_written names {name!r}, which the optimizer updates "
                                  "(its copies are spread over the window and replayed)")
        for s in self.slots:
            s.step_written = s.name in names
        self._at_f_table = None
        self._windows.clear()

    def copy_param_at_f(self, names) -> List[str]:
        """From now on, copy the parameters of the slots named ``names`` at F (with the last
        capture group, under the next forward/backward) and replay only their moments; returns
        those that were not already."""
        changed = []
        for s in self.slots:
            if s.name in names and not s.param_at_f and not s.static:
                s.param_at_f = True
                changed.append(s.name)
        if changed:
            self._windows.clear()
        return changed

    def copy_at_f(self, names) -> List[str]:
        """From now on, copy the slots named ``names`` directly at F; returns those that were
        not already."""
        if not names:
            return []  # (the usual case: a loop over every slot at each checkpoint's start)
        changed = []
        for s in self.slots:
            if s.name in names and (not s.at_f or s.step_written):
                s.at_f, s.step_written = True, False
                changed.append(s.name)
        if changed:  # what depends on which slots are copied at F
            self._at_f_table = None
            self._windows.clear()
        return changed

    @cached_property
    def params(self) -> List[torch.Tensor]:
        """Every slot's parameter as the optimizer holds it, as a list."""
        return [s.param for s in self.slots]

    def locals(self) -> List[torch.Tensor]:
        """Every slot's :attr:`Slot.local` tensor, as a list (:attr:`params` itself when no
        parameter is a DTensor; read anew otherwise: a DTensor's shard may be replaced)."""
        return [s.local for s in self.slots] if self.dtensors else self.params

    @cached_property
    def dtensors(self) -> bool:
        """Whether some parameter is a DTensor (its memory: its local shard)."""
        return any(s.global_slice is not None for s in self.slots)

    @cached_property
    def slot_of_id(self) -> Dict[int, int]:
        """``id()`` of each planned parameter -> its slot index."""
        return {id(s.param): si for si, s in enumerate(self.slots)}

    @cached_property
    def optimized_slots(self) -> List[int]:
        """The index of every optimized slot."""
        return [si for si, s in enumerate(self.slots) if not s.static]

    @cached_property
    def optimized(self) -> List[Tuple[int, int]]:
        """(slot index, optimizer state index) of every optimized slot."""
        return [(si, s.opt_index) for si, s in enumerate(self.slots) if not s.static]

    def in_groups(self, groups) -> "np.ndarray":
        """Per slot: whether it is optimized by one of the param groups ``groups`` (a bool
        array, built once per tuple of groups)."""
        key = tuple(groups)
        if key not in self._in_groups:
            wanted = set(key)
            self._in_groups[key] = np.fromiter(
                (not s.static and s.group in wanted for s in self.slots), bool, len(self.slots))
        return self._in_groups[key]

    @cached_property
    def contiguous(self) -> bool:
        """Whether every slot was planned contiguous (its memory order: the tensor's own):
        then a tensor is laid out like its parameter exactly when it is contiguous."""
        return not any(s.dims for s in self.slots)

    @cached_property
    def strides(self) -> List[Tuple[int, ...]]:
        """Every slot's planned strides, as a list."""
        return [s.strides for s in self.slots]

    @cached_property
    def group_indices(self) -> Optional[List[List[int]]]:
        """Per param group, its parameters' indices as ``optimizer.state_dict()`` numbers them;
        None when a parameter is listed twice (torch then numbers it once)."""
        optimized = [s for s in self.slots if not s.static]
        if len({id(s.param) for s in optimized}) != len(optimized):
            return None
        indices: List[List[int]] = [[] for _ in self.fingerprint]
        for s in optimized:
            indices[s.group].append(s.opt_index)
        return indices

    def optimized_bytes(self) -> int:
        """Bytes of the parameters the optimizer updates (one gradient or state tensor each)
        that this rank holds."""
        return self._bytes[1]

    def state_bytes(self, state_tensors_per_param: int) -> int:
        """Bytes of one full copy of what this rank holds: every param plus its aligned state
        tensors."""
        params, optimized = self._bytes
        return params + state_tensors_per_param * optimized

    @cached_property
    def _bytes(self) -> tuple:
        """(bytes of every parameter, of the optimized ones)."""
        sizes = [(s.held * s.local.element_size(), s.static) for s in self.slots]
        return (sum(n for n, _ in sizes), sum(n for n, static in sizes if not static))

    def groups(self, k: int) -> List[List[Block]]:
        """Split the blocks into ``k`` capture groups of about equal bytes, in storage order
        (group j is copied during the j-th step of the checkpoint).  Computed once per K."""
        return self._window(k)[0]

    def group_tables(self, k: int) -> list:
        """The groups of :meth:`groups` as ``BlockTable``s (built once per K)."""
        return self._window(k)[1]

    def group_param_tables(self, k: int) -> list:
        """Per group, the blocks whose *parameter* it copies: its own, but for the slots whose
        parameter is copied at F (:attr:`Slot.param_at_f`), whose every block's parameter the
        last group copies (at version F, like the rest of that group).  The group tables
        themselves where no slot's parameter is copied at F."""
        return self._window(k)[2]

    def landed_tables(self, k: int) -> list:
        """Groups 1..j of :meth:`groups` as one ``BlockTable`` at index j - 1 (built once per
        K): the blocks a window has captured when its first j groups have landed."""
        return self._window(k)[3]

    def _window(self, k: int) -> tuple:
        if k not in self._windows:
            groups = self._split(k)
            tables = [BlockTable(g) for g in groups]
            params = tables
            if any(s.param_at_f for s in self.slots):
                late = [b for b in self.blocks if self.slots[b.slot].param_at_f
                        and not self.slots[b.slot].at_f]
                params = [BlockTable([b for b in g if not self.slots[b.slot].param_at_f]
                                     + (late if j == len(groups) - 1 else []))
                          for j, g in enumerate(groups)]
            landed = [BlockTable.concat(tables[:j]) for j in range(1, len(tables) + 1)]
            self._windows[k] = (groups, tables, params, landed)
        return self._windows[k]

    def _split(self, k: int) -> List[List[Block]]:
        """The replayed blocks in ``k`` groups of about equal weight, the last one also
        copying the step_written blocks (at version F, as the group) and taking as much less
        of the others: their weight, in the same units of 4 bytes, ends the split."""
        blocks = [b for b in self.blocks if not self.slots[b.slot].at_f]
        k = max(1, min(k, len(blocks))) if blocks else 1
        weights = [b.numel * 3 for b in blocks]  # the parameter and its two moments (fp32)
        late = [b for b in self.blocks if self.slots[b.slot].step_written]
        if not late:
            return split_by_weight(blocks, weights, k)
        reserve = sum(b.numel * self.slots[b.slot].local.element_size() for b in late) / 4
        groups = split_by_weight(blocks + [None], weights + [reserve], k)
        groups[-1] = [b for b in groups[-1] if b is not None] + late
        return groups

    def shares(self, n: int, replicas: Optional[Tuple[int, ...]] = None) -> List[List[Block]]:
        """The blocks of the replicated slots held by ``replicas`` (:attr:`Slot.replicas`;
        None: by every rank) split into ``n`` shares of about equal bytes (a block weighs its
        parameter's bytes, plus 8 per element for an optimized slot's two fp32 moments), each
        in storage order: share i is what the i-th of ``n`` identical replicas copies,
        replays and writes. The blocks replayed and those copied at F are split apart -- each
        share takes a contiguous run of each kind -- so that the replay's work (and the K its
        blocks allow) is balanced too; a slot's blocks in a share are one run. A pure function
        of the plan: every replica computes the same split without a collective. A share may
        be empty (more replicas than blocks)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"the number of shares must be an int >= 1, got {n!r}")
        alike = set(self.held_alike(replicas))
        out: List[List[Block]] = [[] for _ in range(n)]
        for at_f in (False, True):
            blocks = [b for b in self.blocks
                      if b.slot in alike and self.slots[b.slot].at_f == at_f]
            weights = [b.numel * (self.slots[b.slot].local.element_size()
                                  + (0 if self.slots[b.slot].static else 8)) for b in blocks]
            for share, run in zip(out, split_by_weight(blocks, weights, n)):
                share += run
        order = {id(b): i for i, b in enumerate(self.blocks)}
        return [sorted(share, key=lambda b: order[id(b)]) for share in out]

    def replica_sets(self) -> List[Optional[Tuple[int, ...]]]:
        """The distinct :attr:`Slot.replicas` of the replicated slots, in slot order."""
        return list(dict.fromkeys(s.replicas for s in self.slots if s.replicated))

    def held_alike(self, replicas: Optional[Tuple[int, ...]]) -> List[int]:
        """The replicated slots (indices) that the set ``replicas`` holds alike."""
        return [si for si, s in enumerate(self.slots)
                if s.replicated and s.replicas == replicas]

    def take_share(self, rank: int, n: int) -> None:
        """Hold only this rank's share of the replicated slots from now on -- for each set of
        replicas (:attr:`Slot.replicas`: every one of the ``n`` ranks, or a DTensor's), share
        i of :meth:`shares` among them, i this rank's place in the set -- and every block of
        the slots that are this rank's own (not :attr:`Slot.replicated`): these are the blocks
        it copies, replays and writes, and each replicated slot's extent narrows to its
        elements in the share (empty where the slot lies in other shares); ``k_cap`` is the
        fewest blocks any replica of this rank's sets replays, its own blocks counted (the
        ranks then agree on the least). Called once, right after planning (nothing derived
        from the blocks is built yet)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ConfigError(f"share {rank!r} of {n!r} asked: expected 0 <= rank < n")
        picked, extents = set(), {}
        replays = sum(not self.slots[b.slot].at_f for b in self.blocks
                      if not self.slots[b.slot].replicated)
        for replicas in self.replica_sets():
            members = tuple(range(n)) if replicas is None else replicas
            if rank not in members:
                raise ConfigError(f"rank {rank} is not among the replicas {list(members)} of "
                                  "a tensor it holds")
            every = self.shares(len(members), replicas)
            replays += min(sum(not self.slots[b.slot].at_f for b in share) for share in every)
            mine = every[members.index(rank)]
            picked.update(mine)
            for b in mine:  # a share is contiguous: one run of blocks per slot
                lo, hi = extents.get(b.slot, (b.start, b.end))
                extents[b.slot] = (min(lo, b.start), max(hi, b.end))
        self.k_cap = max(1, replays)
        for si, s in enumerate(self.slots):
            if s.replicated:
                s.extent = extents.get(si, (0, 0))
        self.blocks = [b for b in self.blocks if b in picked or not self.slots[b.slot].replicated]
        self.share = (rank, n)
        self._at_f_table = None
        self._windows.clear()
        self.__dict__.pop("_bytes", None)

    def extents(self, slots=None) -> Dict[int, Tuple[int, int]]:
        """slot -> its extent, for ``slots`` (default: every slot) of which this rank holds
        an element, in slot order: what host memory is laid out for."""
        picked = range(len(self.slots)) if slots is None else slots
        return {si: self.slots[si].extent for si in picked if self.slots[si].here}


def split_by_weight(items: list, weights: List[int], k: int) -> List[list]:
    """``items``, in order, cut into ``k`` contiguous runs of about equal total weight: each
    item goes to the run its weight's midpoint falls in, so every run is within one item's
    weight of total/k (the same split wherever it is computed)."""
    total = sum(weights)
    out: List[list] = [[] for _ in range(k)]
    acc = 0
    for item, w in zip(items, weights):
        j = min(k - 1, int((acc + w / 2) * k / total)) if total else 0
        out[j].append(item)
        acc += w
    return out
