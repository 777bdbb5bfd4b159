"""gockpt.core.blocks: blocks as numpy columns and the addresses computed from them."""

from __future__ import annotations

import numpy as np
import torch

from gockpt.core.plan import Block
from gockpt.core.blocks import BlockTable, addresses, itemsizes, slot_array


def test_a_table_holds_the_blocks_as_columns():
    blocks = [Block(2, 0, 4), Block(0, 8, 16), Block(2, 4, 6)]
    t = BlockTable(blocks)
    assert len(t) == 3 and t.blocks == blocks
    assert t.slot.tolist() == [2, 0, 2] and t.start.tolist() == [0, 8, 4]
    assert t.numel.tolist() == [4, 8, 2] and t.slots.tolist() == [0, 2]
    assert t.where(np.array([True, False, True])).blocks == [blocks[0], blocks[2]]
    assert len(BlockTable([])) == 0


def test_addresses_of_blocks_from_per_slot_bases():
    tensors = [torch.zeros(16), torch.zeros(8, dtype=torch.float64), torch.zeros(6)]
    base = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    t = BlockTable([Block(0, 4, 8), Block(1, 3, 5), Block(2, 0, 6)])
    got = addresses(t, base, itemsizes(tensors))
    assert got.tolist() == [tensors[0][4:].data_ptr(), tensors[1][3:].data_ptr(),
                            tensors[2].data_ptr()]
    assert slot_array(4, {1: 7, 3: 9}).tolist() == [0, 7, 0, 9]


def test_derived_tables_match_tables_built_from_blocks():
    a = BlockTable([Block(0, 0, 4), Block(2, 8, 10)])
    b = BlockTable([Block(1, 4, 12)])
    both = BlockTable.concat([a, b])
    assert both.blocks == a.blocks + b.blocks and len(both) == 3
    assert list(both.slots) == [0, 1, 2]
    picked = both.where(np.array([True, False, True]))
    assert picked.blocks == [Block(0, 0, 4), Block(1, 4, 12)]
    assert list(picked.numel) == [4, 8] and len(BlockTable.concat([])) == 0
