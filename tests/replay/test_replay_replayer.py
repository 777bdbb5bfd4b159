"""gockpt.replay.replayer: the replay thread applies step records in arrival order, fails only
the job whose record failed, and always gives the gradient buffers back."""

from __future__ import annotations

import threading

import pytest
import torch

from gockpt.capture.device import HostDevice
from gockpt.core.memory import flat
from gockpt.core.plan import Block
from gockpt.core.planning import build_plan
from gockpt.core.blocks import BlockTable
from gockpt.core.staging import GradPool, HostCopy
from gockpt.capture.transfer import Ticket
from gockpt.core.job import Job, State
from gockpt.replay.adapters import adapter_for
from gockpt.core.records import StepRecord
from gockpt.replay.replayer import Replayer


class LogAdapter:
    """Records which (step, block) it applied; raises for ``fail_on``."""

    def __init__(self, fail_on=None):
        self.log = []
        self.fail_on = fail_on

    def apply(self, record, host, threads):
        for block in record.blocks:  # the real adapter: one batched call per record
            if (record.step_index, block) == self.fail_on:
                raise RuntimeError("replay kernel failed")
            self.log.append((record.step_index, block))


class GateTicket:
    """A transfer ticket that lands when the test opens it."""

    def __init__(self, error=None):
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.error = error

    def wait(self):
        self.waiting.set()
        assert self.gate.wait(30)
        if self.error is not None:
            raise self.error


def blocks(slot, n=3):
    return [Block(slot, 8 * i, 8 * (i + 1)) for i in range(n)]


def record(step, blks, released, ticket=None, final=False):
    return StepRecord(step, {}, {}, BlockTable(blks), {}, None, ticket or Ticket(0, 0),
                      lambda: released.append(step), final=final)


def new_job():
    return Job(1, 3, 1, [[]], "gockpt", "x", host=None)


@pytest.fixture
def replayer():
    made = []

    def make(adapter):
        r = Replayer(adapter, 1)
        made.append(r)
        return r
    yield make
    for r in made:
        if r._thread.is_alive():
            r.close()


def barrier_event(rep, log):
    seen, done = [], threading.Event()

    def callback():
        seen.extend(log)
        done.set()
    rep.barrier(callback)
    return seen, done


def test_records_are_applied_in_arrival_order(replayer):
    ad = LogAdapter()
    rep = replayer(ad)
    job, released = new_job(), []
    slow = GateTicket()
    rep.submit(record(1, blocks(0), released, ticket=slow), job)
    rep.submit(record(2, blocks(1), released), job)  # its gradients are already there
    rep.submit(record(3, blocks(2), released), job)
    seen, done = barrier_event(rep, ad.log)
    assert slow.waiting.wait(30)
    assert ad.log == []  # record 2 does not overtake record 1
    slow.gate.set()
    assert done.wait(30)
    expected = [(1, b) for b in blocks(0)] + [(2, b) for b in blocks(1)] + \
        [(3, b) for b in blocks(2)]
    assert ad.log == expected
    assert seen == expected  # the barrier ran after everything queued before it
    assert released == [1, 2, 3]
    assert job.error is None and job.state is State.CAPTURING


def test_a_failing_record_fails_only_its_job_and_releases_its_buffers(replayer):
    bad_block = blocks(0)[1]
    ad = LogAdapter(fail_on=(1, bad_block))
    rep = replayer(ad)
    a, b, released = new_job(), new_job(), []
    failures = []
    a.on_fail = failures.append
    rep.submit(record(1, blocks(0), released), a)
    rep.submit(record(2, blocks(1), released), a)
    rep.submit(record(3, blocks(2), released), b)
    seen, done = barrier_event(rep, ad.log)
    assert done.wait(30)
    assert isinstance(a.error, RuntimeError) and a.state is State.FAILED
    assert failures == [a]
    assert b.error is None
    # job a: the block before the failure only, nothing of its later record; job b: all
    assert ad.log == [(1, blocks(0)[0])] + [(3, x) for x in blocks(2)]
    assert released == [1, 2, 3]


def test_a_failed_gradient_copy_fails_the_job(replayer):
    ad = LogAdapter()
    rep = replayer(ad)
    job, released = new_job(), []
    ticket = GateTicket(error=RuntimeError("copy failed"))
    ticket.gate.set()
    rep.submit(record(1, blocks(0), released, ticket=ticket), job)
    seen, done = barrier_event(rep, ad.log)
    assert done.wait(30)
    assert str(job.error) == "copy failed" and ad.log == [] and released == [1]


def test_blocks_of_the_final_step_are_handed_on_as_they_reach_F(replayer):
    ad = LogAdapter()
    rep = replayer(ad)
    job, released, finals = new_job(), [], []
    job.on_final = lambda j, bs: finals.append((list(bs), len(ad.log)))
    rep.submit(record(1, blocks(0), released), job)
    rep.submit(record(2, blocks(1), released, final=True), job)
    _, done = barrier_event(rep, ad.log)
    assert done.wait(30)
    # the final step's blocks together, once replayed; none of the earlier step
    assert finals == [(blocks(1), 6)]


def test_close_finishes_queued_work_and_joins(replayer):
    ad = LogAdapter()
    rep = replayer(ad)
    job, released = new_job(), []
    for step in (1, 2):
        rep.submit(record(step, blocks(step), released), job)
    rep.close()
    assert not rep._thread.is_alive()
    assert [s for s, _ in ad.log] == [1, 1, 1, 2, 2, 2] and released == [1, 2]


def test_a_real_record_brings_the_host_copy_to_the_next_version(replayer):
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    adapter = adapter_for(opt)
    plan = build_plan(model, opt, 64)
    host = HostCopy(plan, HostDevice())
    host.set_keys({si: {k: s.param for k in adapter.state_keys}
                   for si, s in enumerate(plan.slots)})
    for si, s in enumerate(plan.slots):
        host.param[si].copy_(flat(s.param))
        for k in adapter.state_keys:
            host.state[si][k].zero_()
    model(torch.randn(4, 7)).sum().backward()
    pool = GradPool(plan, HostDevice())
    bufs = pool.acquire()
    arena = pool.arena(bufs, torch.float32)
    for si, s in enumerate(plan.slots):
        bufs[si].copy_(flat(s.param.grad))
    steps = {si: adapter.step_count(s.param) for si, s in enumerate(plan.slots)}
    released = []
    rec = StepRecord(1, adapter.scalars(), steps, BlockTable(plan.blocks), bufs,
                     arena.bases(len(plan.slots)), Ticket(0, 0), lambda: released.append(1))
    opt.step()
    job = Job(1, 2, 1, [plan.blocks], "gockpt", "x", host=host)
    rep = replayer(adapter)
    rep.submit(rec, job)
    _, done = barrier_event(rep, [])
    assert done.wait(30)
    assert job.error is None and released == [1]
    for si, s in enumerate(plan.slots):
        assert torch.equal(host.param[si], flat(s.param)), s.name
        for k in adapter.state_keys:
            assert torch.equal(host.state[si][k], flat(opt.state[s.param][k])), f"{s.name}.{k}"
