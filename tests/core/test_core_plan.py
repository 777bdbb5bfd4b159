import pytest
import torch

from gockpt.core.errors import ConfigError
from gockpt.core.planning import build_plan, mark_parallel

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


@pytest.mark.parametrize("k", [1, 3])
def test_step_written_static_slots_ride_with_the_last_group(k):
    # Config.step_written (DeepSpeed's module weights): not copied at the boundary of F but
    # with the last group, at version F; a write found elsewhere puts them back at F
    model, opt, _ = H.build(optim="adam")  # the frozen layer is static
    plan = build_plan(model, opt, block_bytes=256)
    plan.mark_step_written(["frozen.weight"])
    late = [b for b in plan.blocks if plan.slots[b.slot].name == "frozen.weight"]
    assert late and not set(late) & set(plan.blocks_at_f())
    groups = plan.groups(k)
    assert groups[-1][-len(late):] == late and not any(set(late) & set(g) for g in groups[:-1])
    assert set(plan.group_param_tables(k)[-1].blocks) == set(groups[-1])
    if k > 1:  # the last group carries them: it takes that much less of the replayed blocks
        weight = [sum(3 * b.numel if b not in late else b.numel for b in g) for g in groups]
        assert max(weight) - min(weight) <= 2 * 64 * 3 + 64, weight
    assert plan.copy_at_f(["frozen.weight"]) == ["frozen.weight"]
    assert set(late) <= set(plan.blocks_at_f()) and late[0] not in plan.groups(k)[-1]
    with pytest.raises(ConfigError, match="which the optimizer updates"):
        plan.mark_step_written(["inp.weight"])
    with pytest.raises(ConfigError, match="not a parameter"):
        plan.mark_step_written(["nope"])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shares_split_every_block_once_in_order_by_bytes(n):
    """The replicas' shares: disjoint, covering every block (static ones too), each in
    storage order; of the blocks replayed and of those copied at F each share takes a
    contiguous run within one block of 1/n of their bytes (the replay's work balanced too);
    the same in another process's plan."""
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=256)
    shares = plan.shares(n)
    order = {id(b): i for i, b in enumerate(plan.blocks)}
    assert len(shares) == n and sorted(order[id(b)] for s in shares for b in s) == \
        list(range(len(plan.blocks)))
    for at_f in (False, True):
        kind = [b for b in plan.blocks if plan.slots[b.slot].at_f == at_f]
        runs = [[b for b in share if plan.slots[b.slot].at_f == at_f] for share in shares]
        assert [b for run in runs for b in run] == kind  # contiguous runs, in order
        total = sum(_block_bytes(plan, b) for b in kind)
        biggest = max(_block_bytes(plan, b) for b in kind)
        for run in runs:
            assert abs(sum(_block_bytes(plan, b) for b in run) - total / n) <= biggest
    model2, opt2, _ = H.build()  # another replica: the same split, no collective
    assert build_plan(model2, opt2, block_bytes=256).shares(n) == shares


def test_more_replicas_than_blocks_leave_shares_empty_and_bad_counts_are_refused():
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=1 << 20)  # a block per parameter
    shares = plan.shares(len(plan.blocks) + 3)
    assert sorted((b.slot, b.start) for s in shares for b in s) == \
        sorted((b.slot, b.start) for b in plan.blocks)
    assert sum(not s for s in shares) >= 3
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


@pytest.mark.parametrize("n", [2, 3])
def test_a_share_narrows_every_slot_to_its_elements_there(n):
    """take_share(r, n): the blocks of share r, each slot's extent the span of its blocks in
    it (empty elsewhere); the extents of all the shares tile every slot; the bytes a rank
    counts for staging and K are its share's."""
    model, opt, _ = H.build()
    whole = build_plan(model, opt, block_bytes=256)
    total = whole.state_bytes(2)
    covered = {si: [] for si in range(len(whole.slots))}
    counted = 0
    for r in range(n):
        model2, opt2, _ = H.build()
        plan = build_plan(model2, opt2, block_bytes=256)
        plan.take_share(r, n)
        assert plan.blocks == whole.shares(n)[r] and plan.share == (r, n)
        for si, s in enumerate(plan.slots):
            mine = [b for b in plan.blocks if b.slot == si]
            assert s.extent == ((mine[0].start, mine[-1].end) if mine else (0, 0))
            assert s.here == bool(mine) and s.whole == (s.extent == (0, s.numel))
            if mine:
                covered[si].append(s.extent)
        assert set(plan.extents()) == {si for si, s in enumerate(plan.slots) if s.held}
        counted += plan.state_bytes(2)
    assert counted == total
    for si, runs in covered.items():
        runs.sort()
        assert runs[0][0] == 0 and runs[-1][1] == whole.slots[si].numel
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


def test_held_and_staged_views_present_the_same_bytes():
    model, opt, _ = H.build()
    plan = build_plan(model, opt, block_bytes=256)
    plan.take_share(1, 2)
    s = next(s for s in plan.slots if s.held and not s.whole)
    lo, hi = s.extent
    live = s.held_view(s.param)
    assert live.dim() == 1 and torch.equal(live, s.param.detach().reshape(-1)[lo:hi])
    staged = live.clone()
    assert s.staged_view(staged) is staged
    with pytest.raises(ConfigError, match="share 2 of 2"):
        plan.take_share(2, 2)


def test_every_replica_caps_k_alike_by_the_smallest_share():
    model, opt, _ = H.build()
    whole = build_plan(model, opt, block_bytes=256)
    n = 3
    counts = [sum(not whole.slots[b.slot].at_f for b in share) for share in whole.shares(n)]
    for r in range(n):
        model2, opt2, _ = H.build()
        plan = build_plan(model2, opt2, block_bytes=256)
        plan.take_share(r, n)
        assert plan.k_cap == min(counts)  # the same on every replica
        assert len(plan.groups(plan.k_cap)) == plan.k_cap
    assert whole.k_cap == 0  # unshared: no cap


def test_each_set_of_replicas_splits_what_it_holds_alike_among_itself():
    """HSDP's layout on 4 ranks: ranks 0 and 2 hold one shard alike, ranks 1 and 3 another
    (Slot.replicas, set here as a DTensor's placements would); each rank takes its place's
    share among its own replicas -- the split and the extents of a 2-way split -- and a rank
    outside a slot's replicas is refused."""
    model, opt, _ = H.build()
    whole = build_plan(model, opt, block_bytes=256)
    for s in whole.slots:
        s.replicas = (0, 2)
    shares = whole.shares(2, (0, 2))
    assert sorted((b.slot, b.start) for share in shares for b in share) == \
        sorted((b.slot, b.start) for b in whole.blocks)
    assert whole.shares(2) == [[], []]  # none is held by every rank
    for rank, place in ((0, 0), (2, 1)):
        model2, opt2, _ = H.build()
        plan = build_plan(model2, opt2, block_bytes=256)
        for s in plan.slots:
            s.replicas = (0, 2)
        plan.take_share(rank, 4)
        assert plan.blocks == shares[place] and plan.share == (rank, 4)
        assert plan.k_cap == min(sum(not whole.slots[b.slot].at_f for b in share)
                                 for share in shares)
    with pytest.raises(ConfigError, match=r"rank 1 is not among the replicas \[0, 2\]"):
        plan = build_plan(*H.build()[:2], block_bytes=256)
        for s in plan.slots:
            s.replicas = (0, 2)
        plan.take_share(1, 4)


def _zero_like():
    """A ZeRO-1/2-like state: replicated module weights (frozen for the optimizer) and one
    flat fp32 partition per rank, which the optimizer updates."""
    model = torch.nn.Module()
    model.module = torch.nn.Linear(8, 6)
    model.master = torch.nn.Parameter(torch.randn(40))
    opt = torch.optim.AdamW([model.master])
    return model, opt


@pytest.mark.parametrize("n", [2, 3])
def test_only_replicated_slots_are_split_and_each_rank_keeps_its_own_whole(n):
    replicated = ["module.weight", "module.bias"]
    whole = build_plan(*_zero_like(), block_bytes=64)
    mark_parallel(whole, replicated, {"master": ((n * 40,), (0,))})
    shared = [b for b in whole.blocks if whole.slots[b.slot].replicated]
    own = [b for b in whole.blocks if not whole.slots[b.slot].replicated]
    assert [b for share in whole.shares(n) for b in share] == shared and own
    for r in range(n):
        plan = build_plan(*_zero_like(), block_bytes=64)
        assert mark_parallel(plan, replicated, {"master": ((n * 40,), (r * 40,))})
        plan.take_share(r, n)
        assert plan.blocks == [b for b in whole.blocks if b in set(whole.shares(n)[r]) or b in own]
        master = next(s for s in plan.slots if s.name == "master")
        assert master.whole and master.global_slice == ((n * 40,), (r * 40,))
        # the partition's blocks are this rank's, counted in the K every rank can fill
        assert plan.k_cap == len(own)  # (the module's weights are static: copied at F)


def test_mark_parallel_says_what_is_replicated_and_where_a_partition_lies():
    plan = build_plan(*_zero_like(), block_bytes=64)
    assert mark_parallel(plan, True, None) and all(s.replicated for s in plan.slots)
    assert not mark_parallel(plan, False, None) and not any(s.replicated for s in plan.slots)
    for replicated, slices, match in (
            (["nope"], {"master": ((80,), (0,))}, "names 'nope', which is not a parameter"),
            (["module.weight", "module.bias"], {}, "'master' is neither replicated nor a slice"),
            (["module.weight", "module.bias", "master"], {"master": ((80,), (0,))},
             "'master' is named in Config.replicated but is a slice"),
            (["module.weight", "module.bias"], {"master": ((80,), (50,))}, "does not fit"),
            (["module.weight", "module.bias"], {"master": ((80, 1), (0, 0))}, "does not fit"),
            (True, {"master": ((80,), (0,))}, "replicated=True\\) with global_slices")):
        with pytest.raises(ConfigError, match=match):
            mark_parallel(build_plan(*_zero_like(), block_bytes=64), replicated, slices)


@pytest.mark.parametrize("numel,k,ranks", [(2940, 3, 4), (1001, 2, 3), (40, 3, 8)])
def test_blocks_are_cut_so_that_every_replicas_share_can_fill_k_groups(numel, k, ranks):
    """An explicit K on N replicas: the plan cuts blocks small enough that each of the N
    shares gets K blocks to replay (as far as there are elements): one flat fp32 group of
    DeepSpeed ZeRO 0 on 4 ranks with K=3 is not capped to K=2 by a ragged last block."""
    flat = torch.nn.Parameter(torch.zeros(numel))
    model = torch.nn.Module()
    model.flat = flat
    plan = build_plan(model, torch.optim.AdamW([flat]), block_bytes=1 << 20, min_blocks=k,
                      ranks=ranks)
    fewest = min(len(share) for share in plan.shares(ranks))
    assert fewest >= min(k, numel // ranks), [len(s) for s in plan.shares(ranks)]
    plan.take_share(0, ranks)
    assert plan.k_cap == fewest
