"""Which stored tensor holds which range of the host arenas, and the manifest's references.

A large slot is stored as its own tensor, named after it (``model/<name>``,
``optim/<index>/<key>``), in its memory order (flat when this rank holds a share of it: its
extent); the small slots of one arena are stored together
as one 1-D *pack* (``pack/model/<dtype>``, ``pack/optim/<key>/<dtype>``), since they lie back to
back in the arena. Both are written straight from the arenas, in as few ranges as possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..core.plan import Plan
from ..core.blocks import BlockTable
from ..core.staging import Arena, HostCopy
from .format import DTYPE_TO_CODE
from .schema import optim_tensor, pack_name, param_tensor
from .refs import TensorRef


@dataclass
class Stored:
    """One stored tensor: ``numel`` elements of ``arena`` from ``start``, stored as ``shape``."""

    arena: Arena
    start: int
    numel: int
    shape: Tuple[int, ...]

    def view(self) -> torch.Tensor:
        return self.arena.buffer[self.start:self.start + self.numel].view(self.shape)


@dataclass
class StoredLayout:
    """The stored tensors of one checkpoint and where each slot's roles went."""

    tensors: Dict[str, Stored] = field(default_factory=dict)
    where: Dict[Tuple[int, Optional[str]], Tuple[str, int]] = field(default_factory=dict)
    """(slot, None for the parameter or a state key) -> (stored name, element offset in it of
    the slot's extent)."""
    param_refs: Dict[str, TensorRef] = field(default_factory=dict)
    state_refs: Dict[int, Dict[str, TensorRef]] = field(default_factory=dict)

    def ranges(self, blocks) -> List[Tuple[str, int, torch.Tensor]]:
        """(stored name, element start, host data) to write for ``blocks``: adjacent ranges of
        one stored tensor merged into one write (a pack of small slots is one range)."""
        if not blocks:
            return []
        table = blocks if isinstance(blocks, BlockTable) else BlockTable(blocks)
        name_idx, starts, sizes = [], [], []
        for index, base in self._columns.values():  # per role: arrays indexed by slot
            rows = index[table.slot] >= 0
            name_idx.append(index[table.slot[rows]])
            starts.append(base[table.slot[rows]] + table.start[rows])
            sizes.append(table.numel[rows])
        name_idx, starts, sizes = (np.concatenate(x) for x in (name_idx, starts, sizes))
        order = np.lexsort((starts, name_idx))
        name_idx, starts, sizes = name_idx[order], starts[order], sizes[order]
        # a run continues where the previous piece of the same tensor ends
        new_run = np.ones(len(starts), dtype=bool)
        new_run[1:] = (name_idx[1:] != name_idx[:-1]) | (starts[1:] != starts[:-1] + sizes[:-1])
        heads = np.flatnonzero(new_run)
        lengths = np.add.reduceat(sizes, heads)
        out = []
        for h, n in zip(heads.tolist(), lengths.tolist()):
            name = self._names[name_idx[h]]
            st, start = self.tensors[name], int(starts[h])
            out.append((name, start, st.arena.buffer[st.start + start:st.start + start + n]))
        return out

    def index(self, plan: Plan) -> "StoredLayout":
        """Per role, the stored tensor of every slot and the element offset its element 0
        would have there (the extent's offset minus its first element), as arrays."""
        n_slots = len(plan.slots)
        self._names = list(self.tensors)
        number = {name: i for i, name in enumerate(self._names)}
        self._columns: Dict[Optional[str], Tuple[np.ndarray, np.ndarray]] = {}
        for (si, role), (name, base) in self.where.items():
            index, bases = self._columns.setdefault(
                role, (np.full(n_slots, -1, dtype=np.int64), np.zeros(n_slots, dtype=np.int64)))
            index[si], bases[si] = number[name], base - plan.slots[si].extent[0]
        return self


def stored_layout(plan: Plan, host: HostCopy, aligned: Dict[int, tuple]) -> StoredLayout:
    """The layout of one checkpoint; ``aligned``: optimizer index -> state keys it has at F."""
    out = StoredLayout()
    for dtype, arena in host.param_arenas.items():
        _place(out, arena, pack_name(None, DTYPE_TO_CODE[dtype]),
               {si: param_tensor(plan.slots[si].name) for si in arena.offset}, plan, None)
        for si in arena.offset:
            name = plan.slots[si].name
            out.param_refs[name] = _ref(out, plan, si, None)
    for (key, dtype), arena in host.state_arenas.items():
        slots = {si: optim_tensor(plan.slots[si].opt_index, key) for si in arena.offset
                 if key in aligned.get(plan.slots[si].opt_index, ())}
        _place(out, arena, pack_name(key, DTYPE_TO_CODE[dtype]), slots, plan, key)
        for si in slots:
            out.state_refs.setdefault(plan.slots[si].opt_index, {})[key] = \
                _ref(out, plan, si, key)
    return out.index(plan)


def _place(out: StoredLayout, arena: Arena, pack_name: str, names: Dict[int, str], plan: Plan,
           role: Optional[str]) -> None:
    """Stored tensors of ``arena`` for the slots in ``names``: one each for the large ones,
    one pack for the small ones (the whole packed range, dead slots included)."""
    small = set(arena.small)
    packed = [si for si in arena.small if si in names]
    if packed:
        lo, hi = arena.pack
        out.tensors[pack_name] = Stored(arena, lo, hi - lo, (hi - lo,))
        for si in packed:
            out.where[(si, role)] = (pack_name, arena.offset[si] - lo)
    for si, name in names.items():
        if si not in small:  # whole: in its shape (memory order); a share: flat
            slot = plan.slots[si]
            out.tensors[name] = Stored(arena, arena.offset[si], arena.sizes[si],
                                       slot.stored_shape if slot.whole else (slot.held,))
            out.where[(si, role)] = (name, 0)


def _ref(out: StoredLayout, plan: Plan, si: int, role: Optional[str]) -> TensorRef:
    name, base = out.where[(si, role)]
    slot = plan.slots[si]
    if not slot.whole:
        return TensorRef(name, base, tuple(slot.local.shape), slot.dims, extent=slot.extent)
    if name.startswith("pack/"):
        return TensorRef(name, base, tuple(slot.local.shape), slot.dims)
    return TensorRef(name, 0, None, slot.dims)
