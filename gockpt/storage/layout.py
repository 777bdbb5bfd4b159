"""Which stored tensor holds which range of the host arenas, and the manifest's references.

A large slot is stored as its own tensor, named after it (``model/<name>``,
``optim/<index>/<key>``), in its memory order; the small slots of one arena are stored together
as one 1-D *pack* (``pack/model/<dtype>``, ``pack/optim/<key>/<dtype>``), since they lie back to
back in the arena. Both are written straight from the arenas, in as few ranges as possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..capture.plan import Plan
from ..capture.staging import Arena, HostCopy
from .format import DTYPE_TO_CODE
from .manifest import optim_tensor, param_tensor
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
    """(slot, None for the parameter or a state key) -> (stored name, element offset in it)."""
    param_refs: Dict[str, TensorRef] = field(default_factory=dict)
    state_refs: Dict[int, Dict[str, TensorRef]] = field(default_factory=dict)

    def ranges(self, blocks) -> List[Tuple[str, int, torch.Tensor]]:
        """(stored name, element start, host data) to write for ``blocks``: adjacent ranges of
        one stored tensor merged into one write (a pack of small slots is one range)."""
        pieces = []
        for b in blocks:
            for (si, role), (name, base) in self._roles_of(b.slot):
                stored = self.tensors[name]
                pieces.append((name, base + b.start, stored, b.numel))
        pieces.sort(key=lambda p: (p[0], p[1]))
        out: List[list] = []
        for name, start, stored, n in pieces:
            if out and out[-1][0] == name and out[-1][1] + out[-1][3] == start:
                out[-1][3] += n
            else:
                out.append([name, start, stored, n])
        return [(name, start, s.arena.buffer[s.start + start:s.start + start + n])
                for name, start, s, n in out]

    def _roles_of(self, si: int):
        return self._by_slot.get(si, ())

    def index(self) -> "StoredLayout":
        self._by_slot: Dict[int, list] = {}
        for key, value in self.where.items():
            self._by_slot.setdefault(key[0], []).append((key, value))
        return self


def stored_layout(plan: Plan, host: HostCopy, aligned: Dict[int, tuple]) -> StoredLayout:
    """The layout of one checkpoint; ``aligned``: optimizer index -> state keys it has at F."""
    out = StoredLayout()
    for dtype, arena in host.param_arenas.items():
        _place(out, arena, f"pack/model/{DTYPE_TO_CODE[dtype]}",
               {si: param_tensor(plan.slots[si].name) for si in arena.offset}, plan, None)
        for si in arena.offset:
            name = plan.slots[si].name
            out.param_refs[name] = _ref(out, plan, si, None)
    for (key, dtype), arena in host.state_arenas.items():
        slots = {si: optim_tensor(plan.slots[si].opt_index, key) for si in arena.offset
                 if key in aligned.get(plan.slots[si].opt_index, ())}
        _place(out, arena, f"pack/optim/{key}/{DTYPE_TO_CODE[dtype]}", slots, plan, key)
        for si in slots:
            out.state_refs.setdefault(plan.slots[si].opt_index, {})[key] = \
                _ref(out, plan, si, key)
    return out.index()


def _place(out: StoredLayout, arena: Arena, pack_name: str, names: Dict[int, str], plan: Plan,
           role: Optional[str]) -> None:
    """Stored tensors of ``arena`` for the slots in ``names``: one each for the large ones,
    one pack for the small ones (the whole packed range, dead slots included)."""
    packed = [si for si in arena.small if si in names]
    if packed:
        lo, hi = arena.pack
        out.tensors[pack_name] = Stored(arena, lo, hi - lo, (hi - lo,))
        for si in packed:
            out.where[(si, role)] = (pack_name, arena.offset[si] - lo)
    for si, name in names.items():
        if si not in arena.small:
            out.tensors[name] = Stored(arena, arena.offset[si], arena.sizes[si],
                                       plan.slots[si].stored_shape)
            out.where[(si, role)] = (name, 0)


def _ref(out: StoredLayout, plan: Plan, si: int, role: Optional[str]) -> TensorRef:
    name, base = out.where[(si, role)]
    slot = plan.slots[si]
    if name.startswith("pack/"):
        return TensorRef(name, base, tuple(slot.param.shape), slot.dims)
    return TensorRef(name, 0, None, slot.dims)
