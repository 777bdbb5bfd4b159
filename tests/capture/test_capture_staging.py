"""gockpt.capture.staging: host buffers planned once and reused; a pool of gradient buffers
that makes the recording step wait while the replay still holds every set."""

from __future__ import annotations

import threading

import pytest
import torch

from gockpt.capture.device import HostDevice
from gockpt.capture.plan import build_plan
from gockpt.capture.staging import GradPool, HostCopy


@pytest.fixture
def plan():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return build_plan(model, torch.optim.AdamW(model.parameters()), 64)


def test_host_copy_has_one_flat_param_buffer_per_slot(plan):
    host = HostCopy(plan, HostDevice())
    assert [t.numel() for t in host.param] == [s.numel for s in plan.slots]
    assert [t.dtype for t in host.param] == [s.param.dtype for s in plan.slots]
    assert host.keys == [()] * len(plan.slots)
    assert host.nbytes() == sum(s.numel * 4 for s in plan.slots)


def test_set_keys_reuses_buffers_across_checkpoints(plan):
    host = HostCopy(plan, HostDevice())
    like = plan.slots[0].param
    host.set_keys(0, {"exp_avg": like, "exp_avg_sq": like})
    first = dict(host.state[0])
    size = host.nbytes()
    host.set_keys(0, {"exp_avg": like, "exp_avg_sq": like})  # the next checkpoint
    assert all(host.state[0][k] is first[k] for k in first)
    assert host.nbytes() == size == sum(s.numel * 4 for s in plan.slots) + 2 * like.numel() * 4
    assert host.keys[0] == ("exp_avg", "exp_avg_sq")
    assert host.keys[1] == ()  # other slots untouched


def test_set_keys_reallocates_only_the_key_whose_dtype_changed(plan):
    host = HostCopy(plan, HostDevice())
    p = plan.slots[0].param
    host.set_keys(0, {"exp_avg": p, "exp_avg_sq": p})
    kept = host.state[0]["exp_avg"]
    old = host.state[0]["exp_avg_sq"]
    host.set_keys(0, {"exp_avg": p, "exp_avg_sq": p.double()})
    assert host.state[0]["exp_avg"] is kept
    assert host.state[0]["exp_avg_sq"] is not old
    assert host.state[0]["exp_avg_sq"].dtype == torch.float64
    assert host.state[0]["exp_avg_sq"].numel() == p.numel()


def test_set_keys_declares_only_this_checkpoints_keys(plan):
    host = HostCopy(plan, HostDevice())
    p = plan.slots[0].param
    host.set_keys(0, {"exp_avg": p, "exp_avg_sq": p})
    host.set_keys(0, {"momentum_buffer": p})
    assert host.keys[0] == ("momentum_buffer",)


def test_grad_pool_buffers_are_allocated_per_slot_and_reused(plan):
    pool = GradPool(plan, HostDevice())
    bufs = pool.acquire()
    assert bufs == {}
    g = torch.ones(plan.slots[1].numel)
    b1 = pool.buffer(bufs, 1, g)
    assert b1.numel() == plan.slots[1].numel and b1.dtype == torch.float32
    assert pool.buffer(bufs, 1, g) is b1
    assert pool.buffer(bufs, 1, g.double()).dtype == torch.float64
    pool.release(bufs)
    assert any(x is bufs for x in (pool.acquire(), pool.acquire()))  # back, buffers kept
    assert bufs[1].dtype == torch.float64


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
    assert pool.nbytes() == plan.slots[0].numel * 4
