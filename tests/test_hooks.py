"""gockpt.hooks: the time each hook takes, charged to the checkpoint in its window
(BlockedTime), and the optimizer's step pre-/post-hooks (StepHooks)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import gockpt
from gockpt import storage
from gockpt.core.errors import ConsistencyError, HookOrderError
from gockpt.core.job import Job, State
from gockpt.core.planning import build_plan
from gockpt.hooks import BlockedTime, StepHooks
from gockpt.loop import UPDATE, Loop

from tests._support import harness as H


def job(k=1):
    return Job(5, k, 5, [[] for _ in range(k)], "async", "/ck/x")


class Current:
    """What the Checkpointer's ``lambda: self._job`` gives: the job in its window, if any."""

    def __init__(self, job=None):
        self.job = job

    def __call__(self):
        return self.job


def tick():
    """Run until the clock has moved (a block that takes some time, without sleeping)."""
    t = time.perf_counter()
    while time.perf_counter() == t:
        pass


# ------------------------------------------------------------------ BlockedTime

def test_the_time_of_a_block_is_charged_to_the_job_in_its_window():
    j = job()
    blocked = BlockedTime(Current(j))
    t0 = time.perf_counter()
    with blocked("update_begin"):
        tick()
    outside = time.perf_counter() - t0
    assert set(j.metrics.blocked_by_hook_s) == {"update_begin"}
    assert 0 < j.metrics.blocked_s == j.metrics.blocked_by_hook_s["update_begin"] <= outside
    with blocked("update_begin"):
        tick()
    assert j.metrics.blocked_by_hook_s["update_begin"] == j.metrics.blocked_s > 0  # adds up
    assert not j.accounts_closed.is_set()  # still in its window


def test_a_block_that_raises_is_charged_and_raises():
    with BlockedTime(Current(None))("update_begin"):
        tick()  # no job in its window: nothing to charge, nothing raised
    j = job()
    with pytest.raises(HookOrderError, match="misuse"):
        with BlockedTime(Current(j))("update_begin"):
            tick()
            raise HookOrderError("misuse")
    assert set(j.metrics.blocked_by_hook_s) == {"update_begin"} and j.metrics.blocked_s > 0


def test_inner_charges_are_not_counted_twice():
    j = job()
    blocked = BlockedTime(Current(j))
    with blocked("save_checkpoint"):
        with blocked("wait"):
            j.metrics.add_blocked("save_checkpoint_busy_wait", 1000.0)  # charged by inner code
            tick()
    # both blocks lasted far less than what the inner code charged: they add nothing more
    assert j.metrics.blocked_by_hook_s == {"save_checkpoint_busy_wait": 1000.0, "wait": 0.0,
                                           "save_checkpoint": 0.0}
    assert j.metrics.blocked_s == 1000.0


def test_a_job_started_by_the_block_gets_its_time():
    current = Current(None)
    blocked = BlockedTime(current)
    started = job()
    with blocked("save_checkpoint"):
        current.job = started
        tick()
    assert set(started.metrics.blocked_by_hook_s) == {"save_checkpoint"}
    assert started.metrics.blocked_s > 0 and not started.accounts_closed.is_set()


def test_a_job_that_replaces_the_one_in_its_window_gets_the_time():
    old, new = job(k=2), job()
    current = Current(old)
    with BlockedTime(current)("save_checkpoint"):
        old.drop()  # its step was not asked for
        current.job = new  # a checkpoint asked without notice
        tick()
    assert old.metrics.blocked_by_hook_s == {} and old.accounts_closed.is_set()
    assert new.metrics.blocked_s > 0


def test_accounts_are_closed_when_the_window_ends_in_the_block():
    j = job()
    current = Current(j)
    blocked = BlockedTime(current)
    with blocked("update_begin"):
        tick()
    assert not j.accounts_closed.is_set()
    with blocked("update_begin"):
        j.captured()  # the last group landed: every block copied
        tick()
    assert j.accounts_closed.is_set() and j.metrics.blocked_by_hook_s["update_begin"] > 0
    # a job started and copied in one block (a checkpoint asked without notice, K = 1)
    current.job = None
    once = job()
    with blocked("save_checkpoint"):
        current.job = once
        once.captured()
        tick()
    assert once.accounts_closed.is_set() and once.metrics.blocked_s > 0


@pytest.mark.parametrize("end", ["captured", "failed"])
def test_a_job_out_of_its_window_before_the_block_is_not_charged(end):
    j = job()
    if end == "captured":
        j.captured()
    else:
        j.fail(RuntimeError("copy failed"))
    j.accounts_closed.set()  # its metrics are final
    with BlockedTime(Current(j))("update_begin"):
        tick()
    assert j.metrics.blocked_by_hook_s == {}


# ------------------------------------------------------------------ StepHooks

def step_once(model, opt, step):
    x, y = H.batch(step)
    nn.functional.cross_entropy(model(x, step), y).backward()
    opt.step()
    opt.zero_grad()


def bare_hooks(opt, current=None, loop=None):
    """StepHooks with nothing to record: no pipeline, no staging, no replay."""
    current = current or Current(None)
    return StepHooks(opt, loop or Loop(), current, None, None, None, False,
                     BlockedTime(current))


def test_a_step_outside_update_begin_raises_at_the_next_hook(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    with gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched) as ck:
        H.train_steps(model, opt, sched, 0, 1, ck)
        ck.backward_begin()
        step_once(model, opt, 1)  # optimizer.step() before update_begin
        with pytest.raises(HookOrderError, match=r"optimizer.step\(\) ran in phase 'backward': "
                           r"call ck.update_begin\(\) after backward"):
            ck.update_begin()
        # after a step outside the hooks (phase idle), at the next one: backward_begin
        H.train_steps(model, opt, sched, 1, 2, ck)
        step_once(model, opt, 2)
        with pytest.raises(HookOrderError, match="optimizer.step.. ran in phase 'idle"):
            ck.backward_begin()
        # reported once; the loop goes on and checkpoints
        H.train_steps(model, opt, sched, 2, 4, ck, force={4})
    assert storage.list_checkpoints(str(tmp_path)) == [storage.checkpoint_name(4)]
    assert gockpt.verify(str(tmp_path)).ok


def test_a_step_outside_update_begin_fails_the_checkpoint_in_its_window(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    handles, snaps = [], {}

    def on_boundary(step, handle):
        if handle is not None:
            handles.append(handle)
            snaps[step] = H.snapshot(model, opt, sched)

    with gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt", overlap_steps=3,
                             interval=4, scheduler=sched) as ck:
        H.train_steps(model, opt, sched, 0, 2, ck)  # the window of step 4 starts at 2
        ck.backward_begin()
        step_once(model, opt, 2)  # changes the state the window has copied
        with pytest.raises(HookOrderError, match="ran in phase 'backward'"):
            ck.update_begin()
        # the step is taken again; the failed window is not raised a second time
        H.train_steps(model, opt, sched, 2, 8, ck, on_boundary=on_boundary)
    assert [h.final_step for h in handles] == [4, 8]
    assert all(h.done() and h.error is None for h in handles)
    for h in handles:  # each holds the live state at its step, the misplaced update included
        m2, o2, s2 = H.build(seed=7)
        gockpt.load(str(tmp_path), m2, o2, scheduler=s2, tag=os.path.basename(h.path))
        H.assert_same(snaps[h.final_step], H.snapshot(m2, o2, s2))


def test_a_step_in_phase_update_records_no_error():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = Loop()
    hooks = bare_hooks(opt, loop=loop)
    loop.phase = UPDATE
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    loop.raise_pending()  # nothing pending
    hooks.remove()


def test_remove_unregisters_the_optimizer_hooks():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = Loop()
    hooks = bare_hooks(opt, loop=loop)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # phase idle: a misuse, raised at the next hook
    with pytest.raises(HookOrderError, match="ran in phase 'idle"):
        loop.raise_pending()
    hooks.remove()
    before = model.weight.detach().clone()
    opt.step()  # no hook any more: the update alone
    loop.raise_pending()
    assert not torch.equal(model.weight, before)
    hooks.remove()  # twice: nothing left to remove


def test_a_misplaced_step_fails_the_capturing_job_as_reported():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    j = job()
    hooks = bare_hooks(opt, Current(j))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert isinstance(j.error, HookOrderError) and j.state is State.FAILED
    assert j.progress.reported  # the HookOrderError at the next hook reports it
    assert set(j.metrics.blocked_by_hook_s) == {"optimizer_step"}
    hooks.remove()


def test_parameters_changed_during_the_checkpoint_fail_it_for_a_new_plan():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.AdamW(model[0].parameters(), lr=0.1)
    plan = build_plan(model, opt, 512)
    j = Job(5, 2, 5, [[], []], "gockpt", "/ck/x", plan=plan)
    loop = Loop()
    hooks = bare_hooks(opt, Current(j), loop)
    loop.phase = UPDATE
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # the planned groups: nothing to refuse (and no replay to record for)
    assert j.error is None and j.capturing
    opt.add_param_group({"params": model[1].parameters()})
    opt.step()
    assert isinstance(j.error, ConsistencyError)
    assert j.error.adapt is gockpt.core.errors.Adaptation.REPLAN
    assert "parameters changed during the checkpoint" in str(j.error)
    hooks.remove()
