"""gockpt.core.staging: host arenas planned once and reused, small slots packed; a pool of
gradient arenas that makes the recording step wait while the replay still holds every set."""

from __future__ import annotations

import threading

import pytest
import torch

from gockpt.capture.device import HostDevice
from gockpt.core.planning import build_plan
from gockpt.core.staging import (PACK_BYTES, PACK_MIN_COUNT, Arena, GradPool, HostCopy,
                                    StagingAllocation)

from tests._support import harness as H


@pytest.fixture
def plan():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return build_plan(model, torch.optim.AdamW(model.parameters()), 64)


def test_host_copy_views_every_slot_into_one_arena_per_dtype(plan):
    host = HostCopy(plan, HostDevice())
    assert [t.numel() for t in host.param] == [s.numel for s in plan.slots]
    assert [t.dtype for t in host.param] == [s.param.dtype for s in plan.slots]
    arena = host.param_arenas[torch.float32]
    assert len(host.param_arenas) == 1 and arena.numel == sum(s.numel for s in plan.slots)
    for si, view in enumerate(host.param):  # views share the arena's memory, no overlap
        assert view.data_ptr() == arena.buffer.data_ptr() + 4 * arena.offset[si]
    spans = sorted((arena.offset[si], arena.offset[si] + s.numel) for si, s in enumerate(plan.slots))
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert host.keys == [()] * len(plan.slots)
    assert host.nbytes() == sum(s.numel * 4 for s in plan.slots)


def test_many_small_slots_are_packed_after_the_large_ones():
    big = PACK_BYTES // 4                                  # exactly PACK_BYTES: a large slot
    sizes = {0: 3, 1: big, **{s: 5 for s in range(2, PACK_MIN_COUNT + 1)}}
    arena = Arena(HostDevice(), torch.float32, {s: (0, n) for s, n in sizes.items()})
    assert arena.offset[1] == 0                            # the large slot first
    assert arena.offset[0] == big and arena.offset[2] == big + 3 and arena.offset[3] == big + 8
    small = [0] + list(range(2, PACK_MIN_COUNT + 1))
    assert arena.small == small and arena.pack == (big, big + 3 + 5 * (PACK_MIN_COUNT - 1))


def test_a_few_small_slots_stay_apart():
    arena = Arena(HostDevice(), torch.float32, {0: (0, 3), 1: (0, PACK_BYTES // 4), 2: (0, 5)})
    assert arena.small == [] and arena.offset == {0: 0, 1: 3, 2: 3 + PACK_BYTES // 4}


def test_set_keys_reuses_the_arenas_across_checkpoints(plan):
    host = HostCopy(plan, HostDevice())
    likes = {si: {"exp_avg": s.param, "exp_avg_sq": s.param} for si, s in enumerate(plan.slots)}
    host.set_keys(likes)
    first = [dict(st) for st in host.state]
    size = host.nbytes()
    host.set_keys(likes)  # the next checkpoint
    assert all(host.state[si][k] is first[si][k] for si in likes for k in first[si])
    assert host.nbytes() == size == 3 * sum(s.numel * 4 for s in plan.slots)
    assert host.keys[0] == ("exp_avg", "exp_avg_sq")
    assert host.arena_of(0, "exp_avg").view(0).data_ptr() == host.state[0]["exp_avg"].data_ptr()


def test_set_keys_lays_out_again_when_a_dtype_changes(plan):
    host = HostCopy(plan, HostDevice())
    p = plan.slots[0].param
    host.set_keys({0: {"exp_avg": p, "exp_avg_sq": p}})
    old = host.state[0]["exp_avg_sq"]
    host.set_keys({0: {"exp_avg": p, "exp_avg_sq": p.double()}})
    assert host.state[0]["exp_avg_sq"] is not old
    assert host.state[0]["exp_avg_sq"].dtype == torch.float64
    assert host.state[0]["exp_avg_sq"].numel() == p.numel()
    assert host.keys[1] == ()  # slots without state declared carry none


def test_set_keys_declares_only_this_checkpoints_keys(plan):
    host = HostCopy(plan, HostDevice())
    p = plan.slots[0].param
    host.set_keys({0: {"exp_avg": p, "exp_avg_sq": p}})
    host.set_keys({0: {"momentum_buffer": p}})
    assert host.keys[0] == ("momentum_buffer",) and set(host.state[0]) == {"momentum_buffer"}


def test_grad_pool_allocates_one_arena_per_set_and_reuses_it(plan):
    pool = GradPool(plan, HostDevice())
    bufs = pool.acquire()
    assert bufs == {}
    g = torch.ones(plan.slots[1].numel)
    b1 = pool.buffer(bufs, 1, g)
    assert b1.numel() == plan.slots[1].numel and b1.dtype == torch.float32
    assert pool.buffer(bufs, 1, g) is b1
    b0 = pool.buffer(bufs, 0, torch.ones(plan.slots[0].numel))
    assert b0.data_ptr() != b1.data_ptr() and b0.untyped_storage().data_ptr() == \
        b1.untyped_storage().data_ptr()  # one arena for the set
    pool.release(bufs)
    assert any(x is bufs for x in (pool.acquire(), pool.acquire()))  # back, buffers kept
    assert bufs[1] is b1


class ObservedCondition(threading.Condition):
    """A Condition that says when someone starts waiting on it."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def test_grad_pool_acquire_blocks_until_a_set_is_released(plan):
    pool = GradPool(plan, HostDevice(), size=2)
    pool._cv = ObservedCondition()
    first, second = pool.acquire(), pool.acquire()
    got = []
    acquired = threading.Event()

    def recorder():
        got.append(pool.acquire())
        acquired.set()

    t = threading.Thread(target=recorder, daemon=True)
    t.start()
    assert pool._cv.waiting.wait(10)  # the third acquire is waiting: both sets are in use
    assert not acquired.is_set()
    pool.release(second)
    assert acquired.wait(10)
    t.join(10)
    assert got == [second] and got[0] is second
    pool.release(first)
    assert pool.acquire() is first


def test_grad_pool_nbytes_counts_sets_in_use(plan):
    pool = GradPool(plan, HostDevice(), size=2)
    bufs = pool.acquire()
    pool.buffer(bufs, 0, plan.slots[0].param)
    assert pool.nbytes() == sum(s.numel * 4 for s in plan.slots if not s.static)


def test_staging_is_allocated_on_a_background_thread_with_the_expected_keys():
    model, opt, _ = H.build()
    plan = build_plan(model, opt, 256)
    threads = []

    class Recording(HostDevice):
        def empty(self, numel, dtype):
            threads.append(threading.current_thread().name)
            return super().empty(numel, dtype)

    staging = StagingAllocation(plan, Recording(), ("exp_avg", "exp_avg_sq"), (torch.float32,))
    host, pool = staging.take()
    assert threads and set(threads) == {"gockpt-staging"}
    optimized = [si for si, s in enumerate(plan.slots) if not s.static]
    assert host.keys_declared and host.roles() == ("exp_avg", "exp_avg_sq")
    assert all(set(host.state[si]) == {"exp_avg", "exp_avg_sq"} for si in optimized)
    assert pool.nbytes() == GradPool.SIZE * plan.optimized_bytes()  # fp32, every set


def test_a_failed_staging_allocation_is_raised_by_take():
    model, opt, _ = H.build()

    class Full(HostDevice):
        def empty(self, numel, dtype):
            raise RuntimeError("cannot pin memory")

    staging = StagingAllocation(build_plan(model, opt, 256), Full(), None, ())
    with pytest.raises(RuntimeError, match="cannot pin memory"):
        staging.take()


def test_an_arena_holds_extents_and_addresses_them_in_slot_coordinates():
    """A slot's element i lies at bases[slot] + i * itemsize for every i of its extent: a
    block's start addresses the same element in the live tensor and in the host copy."""
    arena = Arena(HostDevice(), torch.float32, {0: (10, 30), 2: (0, 5)})
    assert arena.numel == 25 and arena.view(0).numel() == 20 and arena.view(2).numel() == 5
    bases = arena.bases(3)
    assert bases[1] == 0
    assert bases[0] + 10 * 4 == arena.view(0).data_ptr()
    assert bases[2] == arena.view(2).data_ptr()


def test_a_host_copy_of_a_share_holds_only_its_extents(plan):
    plan.take_share(0, 2)
    host = HostCopy(plan, HostDevice())
    held = sum(s.held * s.param.element_size() for s in plan.slots)
    assert host.nbytes() == held < sum(s.numel * 4 for s in plan.slots)
    base, item = host.bases()
    for si, s in enumerate(plan.slots):
        if s.held:
            assert base[si] + s.extent[0] * item[si] == host.param[si].data_ptr()
        else:
            assert base[si] == 0 and host.param[si].numel() == 0
