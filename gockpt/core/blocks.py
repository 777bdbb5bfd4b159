"""Blocks, and blocks as columns of numpy arrays: the hot path does array arithmetic per
group of blocks (addresses of copies and replays), not a Python loop per block or per tensor.

A :class:`Block` is an element range of a slot (the unit of copy and replay); a
:class:`BlockTable` is built once per list of blocks; :func:`addresses` turns it and a per-slot
base address into one address per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Block:
    """Elements [start, end) of slot ``slot`` (same range in the param and its state)."""

    slot: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class BlockTable:
    """``blocks`` as columns: ``slot``, ``start`` (element offset in the slot), ``numel``.

    Built once per list of blocks (a plan caches its groups' tables); :meth:`where` and
    :meth:`concat` derive tables with array operations, and the ``Block`` objects of a derived
    table are made only if something asks for them (the background stages, not the hooks)."""

    def __init__(self, blocks: Optional[Sequence[Block]] = None, *, columns=None):
        if columns is None:
            self._blocks: Optional[List[Block]] = list(blocks)
            n = len(self._blocks)
            columns = (np.fromiter((b.slot for b in self._blocks), np.int64, n),
                       np.fromiter((b.start for b in self._blocks), np.int64, n),
                       np.fromiter((b.numel for b in self._blocks), np.int64, n))
        else:
            self._blocks = None
        self.slot, self.start, self.numel = columns
        self.slots = np.unique(self.slot)  # the distinct slots, sorted

    @property
    def blocks(self) -> List[Block]:
        if self._blocks is None:
            self._blocks = [Block(s, b, b + n) for s, b, n in
                            zip(self.slot.tolist(), self.start.tolist(), self.numel.tolist())]
        return self._blocks

    def __len__(self) -> int:
        return len(self.slot)

    def where(self, mask: np.ndarray) -> "BlockTable":
        """The blocks whose row of ``mask`` is true."""
        mask = np.asarray(mask, dtype=bool)
        return BlockTable(columns=(self.slot[mask], self.start[mask], self.numel[mask]))

    @staticmethod
    def concat(tables: Sequence["BlockTable"]) -> "BlockTable":
        """The blocks of ``tables``, one after the other."""
        if not tables:
            return BlockTable([])
        return BlockTable(columns=tuple(np.concatenate([getattr(t, c) for t in tables])
                                        for c in ("slot", "start", "numel")))


def addresses(table: BlockTable, base: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Address of every block's first element: ``base[slot] + start * itemsize[slot]``."""
    return base[table.slot] + table.start * itemsize[table.slot]


def slot_array(n_slots: int, values: Dict[int, int]) -> np.ndarray:
    """A per-slot int64 array holding ``values`` (0 elsewhere)."""
    out = np.zeros(n_slots, dtype=np.int64)
    if values:
        out[np.fromiter(values.keys(), np.int64, len(values))] = \
            np.fromiter(values.values(), np.int64, len(values))
    return out


def itemsizes(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """Per slot: the element size of its tensor."""
    return np.fromiter((t.element_size() for t in tensors), np.int64, len(tensors))
