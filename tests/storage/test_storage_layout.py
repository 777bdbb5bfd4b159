"""gockpt.storage.layout: large slots stored one each, many small ones as one pack; writes
merged into as few ranges as the arenas allow."""

from __future__ import annotations

import torch
from torch import nn

from gockpt.capture.device import HostDevice
from gockpt.core.planning import build_plan
from gockpt.core.staging import PACK_BYTES, PACK_MIN_COUNT, HostCopy
from gockpt.storage.layout import stored_layout
from gockpt.storage.refs import TensorRef


def setup(n_small=PACK_MIN_COUNT):
    model = nn.Module()
    model.big = nn.Parameter(torch.randn(PACK_BYTES // 4 + 1))
    model.small = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(n_small)])
    opt = torch.optim.AdamW(model.parameters())
    plan = build_plan(model, opt, 1 << 20)
    host = HostCopy(plan, HostDevice())
    host.set_keys({si: {"exp_avg": s.param} for si, s in enumerate(plan.slots)})
    return plan, host


def test_large_slots_alone_small_ones_packed_with_references():
    plan, host = setup()
    layout = stored_layout(plan, host, {i: ("exp_avg",) for i in range(len(plan.slots))})
    assert set(layout.tensors) == {"model/big", "pack/model/F32", "optim/0/exp_avg",
                                   "pack/optim/exp_avg/F32"}
    assert layout.tensors["pack/model/F32"].numel == 3 * PACK_MIN_COUNT
    assert layout.param_refs["big"] == TensorRef("model/big")
    assert layout.param_refs["small.1"] == TensorRef("pack/model/F32", 3, (3,))
    assert layout.state_refs[2]["exp_avg"] == TensorRef("pack/optim/exp_avg/F32", 3, (3,))


def test_a_slot_without_state_at_f_has_no_reference():
    plan, host = setup()
    layout = stored_layout(plan, host, {0: ("exp_avg",)})
    assert set(layout.state_refs) == {0} and "pack/optim/exp_avg/F32" not in layout.tensors


def test_ranges_merge_adjacent_blocks_of_one_stored_tensor():
    plan, host = setup()
    layout = stored_layout(plan, host, {i: ("exp_avg",) for i in range(len(plan.slots))})
    small = [b for b in plan.blocks if plan.slots[b.slot].name.startswith("small")]
    ranges = layout.ranges(small)
    # every small parameter and its moment: one write each for the two packs
    assert sorted((n, s, d.numel()) for n, s, d in ranges) == [
        ("pack/model/F32", 0, 3 * PACK_MIN_COUNT), ("pack/optim/exp_avg/F32", 0, 3 * PACK_MIN_COUNT)]
    big = [b for b in plan.blocks if plan.slots[b.slot].name == "big"]
    assert {n for n, _, _ in layout.ranges(big)} == {"model/big", "optim/0/exp_avg"}
    assert layout.ranges([]) == []
