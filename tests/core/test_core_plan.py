import pytest
import torch

from gockpt.core.errors import ConfigError
from gockpt.core.plan import build_plan

from tests._support import harness as H


def test_blocks_cover_every_parameter_exactly_once():
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=256)
    for si, slot in enumerate(plan.slots):
        ranges = sorted((b.start, b.end) for b in plan.blocks if b.slot == si)
        assert ranges[0][0] == 0 and ranges[-1][1] == slot.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(e - s <= 64 for s, e in ranges)


def test_optimizer_order_and_static_parameters():
    model, opt, _ = H.build(optim="adam")  # Adam build leaves the frozen layer out
    plan = build_plan(model, opt, block_bytes=1 << 20)
    in_opt = [s for s in plan.slots if not s.static]
    assert [s.opt_index for s in in_opt] == list(range(len(in_opt)))
    static = {s.name for s in plan.slots if s.static}
    assert static == {"frozen.weight", "frozen.bias"}
    assert len(plan.slots) == len(list(model.parameters()))


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_groups_partition_blocks_in_order_and_balance(k):
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=256)
    groups = plan.groups(k)
    assert len(groups) == k
    # the static slots (not the attached optimizer's) are copied at F, apart from the groups
    assert [b for g in groups for b in g] + plan.blocks_at_f() == plan.blocks
    assert {plan.slots[b.slot].name for b in plan.blocks_at_f()} == {"frozen.bias"}
    weights = [sum(b.numel for b in g) for g in groups]
    assert max(weights) - min(weights) <= 2 * 64 * 3


def _block_bytes(plan, b):
    slot = plan.slots[b.slot]
    return b.numel * (slot.param.element_size() + (0 if slot.static else 8))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shares_split_every_block_once_in_order_by_bytes(n):
    """The replicas' shares: disjoint, covering every block (static ones too) in storage
    order, each within one block of S/n bytes, the same in another process's plan."""
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=256)
    shares = plan.shares(n)
    assert len(shares) == n and [b for s in shares for b in s] == plan.blocks
    total = sum(_block_bytes(plan, b) for b in plan.blocks)
    biggest = max(_block_bytes(plan, b) for b in plan.blocks)
    for share in shares:
        assert abs(sum(_block_bytes(plan, b) for b in share) - total / n) <= biggest
    model2, opt2, _ = H.build()  # another replica: the same split, no collective
    assert build_plan(model2, opt2, block_bytes=256).shares(n) == shares


def test_more_replicas_than_blocks_leave_shares_empty_and_bad_counts_are_refused():
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=1 << 20)  # a block per parameter
    shares = plan.shares(len(plan.blocks) + 3)
    assert [b for s in shares for b in s] == plan.blocks and sum(not s for s in shares) >= 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="number of shares"):
            plan.shares(bad)


def test_tied_parameters_become_aliases():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = self.a
    model = Tied()
    plan = build_plan(model, torch.optim.AdamW(model.parameters()), 1024)
    assert plan.aliases == {"b.weight": "a.weight", "b.bias": "a.bias"}


def test_foreign_parameter_is_a_mismatch():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ConfigError, match="mismatch"):
        build_plan(model, opt, 1024)
