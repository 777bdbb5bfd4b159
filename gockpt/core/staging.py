"""Host memory for checkpoints, planned once and reused: one flat *arena* per (role, dtype)
holding every slot back to back (the parameters; each aligned optimizer state key; the
gradients in flight), so that copies, replays and writes work on few large ranges.

Within an arena, large slots come first and the small ones (under ``PACK_BYTES``) after them,
contiguous: when there are many (``PACK_MIN_COUNT``), storage writes them as one packed tensor
instead of one aligned tensor each.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .config import GradTransport
from .errors import ConfigError
from .modes import ModePolicy
from .plan import Plan
from .blocks import slot_array

#: Slots smaller than this are packed together (one stored tensor per arena, one write) ...
PACK_BYTES = 64 << 10
#: ... when an arena has at least this many of them (fewer cost nothing worth packing).
PACK_MIN_COUNT = 32


#: Gradient snapshots a CPU-trained gockpt-o holds (one written while the other is copied)
SNAPSHOTS = 2


def planned_host_bytes(plan: Plan, policy: ModePolicy, device, cap: Optional[int]) -> int:
    """Host memory of one state copy (parameters + two aligned state tensors, Adam-like) plus,
    with a replay, the pool of gradient buffers, and the gradient snapshots gockpt-o's copies
    read where ``device`` takes them (the CPU: its memory is the host's); ConfigError when over
    ``cap``."""
    snapshots = policy.snapshots_gradients(device)
    planned = plan.state_bytes(2)
    if policy.replays:
        planned += GradPool.SIZE * plan.optimized_bytes()
    if snapshots:
        planned += SNAPSHOTS * plan.optimized_bytes()  # float32, as the gradients
    if cap is not None and planned > cap:
        parts = "state copy + gradient buffers" + (" + gradient snapshots" if snapshots else "")
        raise ConfigError(
            f"gockpt needs {planned / 2**20:.1f} MiB of host memory for staging ({parts}) "
            f"but max_host_bytes is {cap / 2**20:.1f} MiB; raise the cap or use a mode "
            "without replay (no gradient buffers)")
    return planned


def gradient_dtypes(replays: bool, grad_transport) -> tuple:
    """The dtypes gradients cross in (none without a replay: no gradient pool)."""
    if not replays:
        return ()
    return (torch.bfloat16,) if grad_transport is GradTransport.BF16 else (torch.float32,)


class Arena:
    """One flat host buffer and the element range of every slot in it.

    A slot's range holds its *extent* (:attr:`gockpt.core.plan.Slot.extent`): all its
    elements, or the share of them this rank holds. Addresses stay in the slot's own
    coordinates: :meth:`bases` gives where its element 0 would be, so that a block's
    ``start`` addresses the same element in the live tensor and here."""

    def __init__(self, device, dtype: torch.dtype, extents: Dict[int, Tuple[int, int]]):
        """``extents``: slot -> (lo, hi), the elements held, in slot order (large slots are
        placed first)."""
        self.dtype = dtype
        itemsize = dtype.itemsize
        sizes = {s: hi - lo for s, (lo, hi) in extents.items()}
        self.first = {s: lo for s, (lo, _) in extents.items()}
        small = [s for s, n in sizes.items() if n * itemsize < PACK_BYTES]
        if len(small) < PACK_MIN_COUNT:
            small = []
        packed = set(small)
        large = [s for s in sizes if s not in packed]
        self.offset: Dict[int, int] = {}
        pos = 0
        for s in large + small:
            self.offset[s] = pos
            pos += sizes[s]
        self.numel = pos
        self.sizes = dict(sizes)
        self.small = small
        self.pack: Tuple[int, int] = (self.offset[small[0]], pos) if small else (pos, pos)
        """Element range of the packed small slots."""
        self.buffer = device.empty(pos, dtype)

    def view(self, slot: int) -> torch.Tensor:
        """The elements of ``slot`` held here (its extent, flat)."""
        o = self.offset[slot]
        return self.buffer[o:o + self.sizes[slot]]

    def bases(self, n_slots: int) -> np.ndarray:
        """Per slot: the address its element 0 has in this arena's coordinates (the extent's
        first element minus its offset in the slot; 0 for slots not in this arena); computed
        once (the buffer never moves), read-only."""
        cached = getattr(self, "_bases", None)
        if cached is None or len(cached) != n_slots:
            base, item = self.buffer.data_ptr(), self.dtype.itemsize
            cached = self._bases = slot_array(n_slots, {s: base + (o - self.first[s]) * item
                                                        for s, o in self.offset.items()})
            cached.flags.writeable = False
        return cached

    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class HostCopy:
    """One host copy of the model's parameters and their aligned optimizer state.

    ``param[si]`` and ``state[si][key]`` are flat views of slot ``si`` into the arenas; the
    arenas are reused by every later checkpoint while the state keys and dtypes stay the same,
    so host memory stays at one copy of the state (plus gradients in flight).
    """

    def __init__(self, plan: Plan, device):
        self.slots = plan.slots
        self.device = device
        by_dtype: Dict[torch.dtype, Dict[int, Tuple[int, int]]] = {}
        for si, extent in plan.extents().items():
            by_dtype.setdefault(plan.slots[si].local.dtype, {})[si] = extent
        self.param_arenas = {d: Arena(device, d, ext) for d, ext in by_dtype.items()}
        # (a slot held by other replicas only: an empty view, never addressed)
        self.param: List[torch.Tensor] = [
            self.param_arenas[s.local.dtype].view(si) if s.here
            else s.local.new_empty(0, device="cpu")
            for si, s in enumerate(plan.slots)]
        self.state_arenas: Dict[Tuple[str, torch.dtype], Arena] = {}
        self.state: List[Dict[str, torch.Tensor]] = [{} for _ in plan.slots]
        self.keys: List[tuple] = [() for _ in plan.slots]  # aligned keys of this checkpoint
        self._key_layout: Optional[tuple] = None
        self._bases: Dict[Optional[str], Tuple[np.ndarray, np.ndarray]] = {}
        self.keys_declared = False
        self.keys_version = 0
        """Bumped whenever the state arenas are laid out again (the parameters' never are):
        what was derived from the arenas (the hooks' segment layouts, a window's bytes, the
        stored layout) holds while it and the host copy are the same."""
        self._sizes: Optional[tuple] = None  # (keys_version, roles(), nbytes())

    def set_keys(self, likes: Dict[int, Dict[str, torch.Tensor]]) -> None:
        """Declare, for every slot with aligned state, its keys (key -> a tensor of the dtype
        its buffer needs). The state arenas are laid out again only when this changes."""
        layout = [(si, [(k, t.dtype) for k, t in kt.items()]) for si, kt in likes.items()]
        if layout != self._key_layout and not self._covers(layout):
            sizes: Dict[Tuple[str, torch.dtype], Dict[int, Tuple[int, int]]] = {}
            for si in sorted(likes):
                if not self.slots[si].here:
                    continue
                for key, like in likes[si].items():
                    sizes.setdefault((key, like.dtype), {})[si] = self.slots[si].extent
            self.state_arenas = {kd: Arena(self.device, kd[1], s) for kd, s in sizes.items()}
            self.state = [{} for _ in self.slots]
            for (key, _), arena in self.state_arenas.items():
                for si in arena.offset:
                    self.state[si][key] = arena.view(si)
            self._key_layout = layout
            self._bases = {}
            self.keys_version += 1
        self.keys = [tuple(likes.get(si, {})) for si in range(len(self.slots))]
        self.keys_declared = True

    def _covers(self, layout) -> bool:
        """Whether the state arenas already hold a buffer for every (slot, key, dtype) of
        ``layout`` (e.g. laid out for every optimized slot before the first checkpoint, when
        some slots have no state yet): then they stay, and only the keys change (what is
        stored follows the keys each slot has at F, not the arenas)."""
        return all((key, dtype) in self.state_arenas
                   and si in self.state_arenas[(key, dtype)].offset
                   for si, keys in layout if self.slots[si].here for key, dtype in keys)

    def roles(self) -> Tuple[str, ...]:
        """The aligned state keys this copy holds (in arena order)."""
        return self._sized()[1]

    def bases(self, key: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Per slot: the address of its element 0 for role ``key`` (None: the parameter; 0
        where the slot has no such role), in the slot's coordinates like
        :meth:`Arena.bases` (the host copy holds its extent), and the element size there."""
        cached = self._bases.get(key)
        if cached is None:
            views = self.param if key is None else [st.get(key) for st in self.state]
            cached = self._bases[key] = (
                np.fromiter((0 if v is None or not s.here
                             else v.data_ptr() - s.extent[0] * v.element_size()
                             for v, s in zip(views, self.slots)), np.int64, len(views)),
                np.fromiter((1 if v is None else v.element_size() for v in views), np.int64,
                            len(views)))
        return cached

    def arena_of(self, si: int, key: Optional[str] = None) -> Arena:
        """The arena holding slot ``si``'s parameter (``key`` None) or state ``key``."""
        if key is None:
            return self.param_arenas[self.slots[si].local.dtype]
        return self.state_arenas[(key, self.state[si][key].dtype)]

    def nbytes(self) -> int:
        return self._sized()[2]

    def _sized(self) -> tuple:
        """(keys_version, roles, bytes) of the arenas as laid out now (worked out once per
        layout: each checkpoint's start asks)."""
        if self._sizes is None or self._sizes[0] != self.keys_version:
            self._sizes = (self.keys_version,
                           tuple(dict.fromkeys(key for key, _ in self.state_arenas)),
                           sum(a.nbytes() for a in self.param_arenas.values()) +
                           sum(a.nbytes() for a in self.state_arenas.values()))
        return self._sizes


def window_bytes(plan: Plan, host: "HostCopy", k: int) -> Tuple[int, int]:
    """(bytes the replay brings to F, bytes copied at version F) of a checkpoint of K steps:
    groups 1..K-1 are replayed (but the parameters copied at F), the last group, the blocks
    copied at F and those parameters are copied at F."""
    tables, params = plan.group_tables(k), plan.group_param_tables(k)
    states = host.roles()

    def nbytes(t, key) -> int:
        base, item = host.bases(key)
        rows = base[t.slot] != 0
        return int((t.numel[rows] * item[t.slot[rows]]).sum())

    def group(j) -> int:
        return nbytes(params[j], None) + sum(nbytes(tables[j], key) for key in states)

    replayed = sum(group(j) for j in range(len(tables) - 1))
    at_f = group(len(tables) - 1) + sum(nbytes(plan.at_f_table, key) for key in (None,) + states)
    return replayed, at_f


class StagingAllocation:
    """The host staging of a plan -- a :class:`HostCopy` with the state keys expected, and the
    :class:`GradPool`'s arenas -- allocated on a background thread started when the
    Checkpointer is built: pinned memory takes seconds per GB on a GPU machine, and the first
    checkpoint must not pay it.  ``take()`` (at the first checkpoint) waits for it.

    ``state_keys``: the aligned state keys every optimized slot will have (a replay adapter's,
    or Adam's), or None; keys found otherwise at the first checkpoint lay the state arenas out
    again there.  ``grad_dtypes``: the gradient arenas to allocate in every pool set (none:
    no pool)."""

    def __init__(self, plan: Plan, device, state_keys: Optional[tuple], grad_dtypes: tuple):
        self._args = (plan, device, state_keys, grad_dtypes)
        self._result: Optional[Tuple[HostCopy, Optional[GradPool]]] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="gockpt-staging", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        plan, device, state_keys, grad_dtypes = self._args
        try:
            host = HostCopy(plan, device)
            if state_keys:
                host.set_keys({si: {k: s.local for k in state_keys}
                               for si, s in enumerate(plan.slots) if not s.static})
            pool = GradPool(plan, device) if grad_dtypes else None
            if pool is not None:
                pool.allocate(grad_dtypes)
            self._result = (host, pool)
        except BaseException as exc:  # raised by take(), on the training thread
            self._error = exc

    def join(self) -> None:
        """Wait until the allocation is over (what it gave is dropped unless taken)."""
        self._thread.join()

    def take(self) -> Tuple[HostCopy, Optional[GradPool]]:
        """The staging, once allocated (raises what allocating it raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class GradPool:
    """A few sets of host gradient arenas, handed out one per recorded step and returned by
    the replay thread once that step has been applied."""

    SIZE = 2  # one set being filled while the replay applies the previous one

    def __init__(self, plan: Plan, device, size: int = SIZE):
        self.plan = plan
        self.device = device
        self._sets: List[Dict[int, torch.Tensor]] = [{} for _ in range(size)]
        self._arenas: Dict[int, Dict[torch.dtype, Arena]] = {id(s): {} for s in self._sets}
        self._free: List[Dict[int, torch.Tensor]] = list(self._sets)
        self._cv = threading.Condition()

    def acquire(self) -> Dict[int, torch.Tensor]:
        """A free buffer set (blocks while the replay still uses all of them)."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            return self._free.pop()

    def buffer(self, bufs: Dict[int, torch.Tensor], slot: int, grad: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s gradient buffer in ``bufs``: its extent's elements (its arena
        allocated on first use, for every optimized slot of the gradient's dtype)."""
        buf = bufs.get(slot)
        if buf is None or buf.dtype != grad.dtype:
            buf = bufs[slot] = self.arena(bufs, grad.dtype).view(slot)
        return buf

    def arena(self, bufs: Dict[int, torch.Tensor], dtype: torch.dtype) -> Arena:
        """The gradient arena of ``dtype`` of the set ``bufs`` (allocated on first use)."""
        arenas = self._arenas[id(bufs)]
        arena = arenas.get(dtype)
        if arena is None:
            extents = self.plan.extents(self.plan.optimized_slots)
            arena = arenas[dtype] = Arena(self.device, dtype, extents)
            bufs.update({si: arena.view(si) for si in extents})  # once per set: its views
        return arena

    def allocate(self, dtypes) -> None:
        """Lay out every set's arena of each of ``dtypes`` now (not at its first use)."""
        for bufs in self._sets:
            for dtype in dtypes:
                self.arena(bufs, dtype)

    def release(self, bufs: Dict[int, torch.Tensor]) -> None:
        with self._cv:
            self._free.append(bufs)
            self._cv.notify()

    def nbytes(self) -> int:
        with self._cv:
            return sum(a.nbytes() for arenas in self._arenas.values() for a in arenas.values())


class HostStaging:
    """The host memory of a Checkpointer across checkpoints: allocated in the background
    from construction (:class:`StagingAllocation`), taken at the first checkpoint, reused by
    the next ones, and let go when the optimizer's parameters change (:meth:`replanned`:
    allocated again, for the new plan, at the next checkpoint).

    ``state_keys``, ``grad_dtypes``: as :class:`StagingAllocation`'s (no gradient dtypes: no
    replay, no gradient pool)."""

    def __init__(self, plan: Plan, device, state_keys: Optional[tuple], grad_dtypes: tuple):
        self.device, self.replays = device, bool(grad_dtypes)
        self.host: Optional[HostCopy] = None
        self.grad_pool: Optional[GradPool] = None
        self._allocation: Optional[StagingAllocation] = \
            StagingAllocation(plan, device, state_keys, grad_dtypes)

    def ready(self, plan: Plan) -> None:
        """Make :attr:`host` (and :attr:`grad_pool` with a replay) ready for ``plan``."""
        if self.host is None and self._allocation is not None:
            allocation, self._allocation = self._allocation, None
            self.host, self.grad_pool = allocation.take()
        if self.host is None:  # planned again: allocated now
            self.host = HostCopy(plan, self.device)
            if self.replays:
                self.grad_pool = GradPool(plan, self.device)

    def replanned(self) -> None:
        """The plan changed: what was allocated for the old one is let go."""
        if self._allocation is not None:
            self._allocation.take()
        self.host, self.grad_pool, self._allocation = None, None, None

    def nbytes(self) -> int:
        """Host memory held (state copy + gradient buffers)."""
        n = self.host.nbytes() if self.host else 0
        return n + (self.grad_pool.nbytes() if self.grad_pool else 0)

    def close(self) -> None:
        if self._allocation is not None:  # never taken: no checkpoint was started
            self._allocation.join()
            self._allocation = None
