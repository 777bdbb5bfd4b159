"""Blocks as columns of numpy arrays: the hot path does array arithmetic per group of blocks
(addresses of copies, digests and replays), not a Python loop per block or per tensor.

A :class:`BlockTable` is built once per list of blocks; :func:`addresses` turns it and a
per-slot base address into one address per block.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch

from .plan import Block


class BlockTable:
    """``blocks`` as columns: ``slot``, ``start`` (element offset in the slot), ``numel``."""

    def __init__(self, blocks: Sequence[Block]):
        self.blocks: List[Block] = list(blocks)
        n = len(self.blocks)
        self.slot = np.fromiter((b.slot for b in self.blocks), np.int64, n)
        self.start = np.fromiter((b.start for b in self.blocks), np.int64, n)
        self.numel = np.fromiter((b.numel for b in self.blocks), np.int64, n)
        self.slots = np.unique(self.slot)  # the distinct slots, sorted

    def __len__(self) -> int:
        return len(self.blocks)

    def where(self, mask: np.ndarray) -> "BlockTable":
        """The blocks whose row of ``mask`` is true."""
        return BlockTable([b for b, keep in zip(self.blocks, mask) if keep])


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
