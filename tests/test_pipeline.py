"""gockpt.pipeline: one job through capture -> replay -> self-check -> persist, driven at the
moments the hooks call it. The stages are fakes that log; the Job and Pipeline are real."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import gockpt
from gockpt import storage
from gockpt.capture.copies import Capture
from gockpt.core.config import Config
from gockpt.core.errors import Adaptation, CheckpointFailedError, ConfigError, ConsistencyError
from gockpt.core.job import Job, State
from gockpt.loop import Loop
from gockpt.pipeline import Pipeline

from tests._support import harness as H


class FakeCapture:
    def __init__(self, log, fail=None):
        self.log, self.fail = log, fail or {}
        self.plan = self.optimizer = None
        # a device that queues training work behind its copies (no gradient snapshots)
        self.engine = SimpleNamespace(device=SimpleNamespace(overlap_needs_snapshot=False))

    def _maybe_fail(self, what):
        if what in self.fail:
            raise self.fail[what]

    def enqueue_group(self, job, j):
        self.log.append(("enqueue", j))
        self._maybe_fail(("enqueue", j))

    def land_group(self, job, j):
        self.log.append(("land", j))
        self._maybe_fail(("land", j))

    def copy_rest(self, job):
        self.log.append(("copy_rest",))
        job.captured()

    def digest_live(self, job, digester):
        self.log.append(("digest",))

    def copy_at_f(self, job):
        self.log.append(("copy at F",))
        return []

    def replaced_states(self, job):
        return self.fail.get("replaced", [])

    def small_state(self, job, extra_state):
        self.log.append(("freeze", job.handle.final_step, extra_state))
        self._maybe_fail("freeze")
        return {"model": {}, "optimizer": {}, "scheduler": None, "rng": None,
                "extra_state": extra_state}, {}, set()

    def gradients(self, job, j, groups, pool, snapshot=False):
        self.log.append(("gradients", j))
        return FakeRecord(self.log, j)


class FakeTicket:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append(("grad wait",))


class FakeRecord:
    def __init__(self, log, j):
        self.step_index, self.ticket, self.snapshot = j, FakeTicket(log), False


class FakeReplayer:
    def __init__(self, log):
        self.log = log

    def submit(self, record, job):
        self.log.append(("replay", record.step_index))

    def barrier(self, callback):
        self.log.append(("barrier",))
        callback()  # the replay thread would run it after the queued records


class FakePersister:
    def __init__(self, log):
        self.log = log
        self.calls = []

    def queue_open(self, job):
        self.log.append(("open",))

    def queue_captured(self, job):
        self.log.append(("write captured",))

    def queue_persist(self, job):
        self.log.append(("queue persist",))

    def queue_call(self, fn):
        self.log.append(("call",))
        self.calls.append(fn)

    def persist(self, job):
        self.log.append(("persist inline",))

    def blocks_final(self, job, blocks):
        self.log.append(("blocks final", len(blocks)))


def make(mode="gockpt-o", k=3, fail=None, start=5):
    log = []
    config = Config(directory="unused", mode=mode, self_check=0.0)
    replayer = FakeReplayer(log) if config.policy.replays else None
    persister = FakePersister(log)
    pipe = Pipeline(config, FakeCapture(log, fail), replayer, persister,
                    lambda step: f"/ck/step-{step}", digester=object())
    job = Job(start, k, start, [[] for _ in range(k)], mode, "/ck/p")
    if config.policy.streams:
        job.on_final = persister.blocks_final
    return pipe, job, log


def run_window(pipe, job, start=5):
    """The hooks of K steps: boundary N (begin), then update_begin / boundary per step."""
    pipe.begin(job, start, start, {"x": 1})
    for boundary in range(start, start + job.k):
        pipe.land(job, job.window_step(boundary))
        if boundary + 1 < start + job.k:
            pipe.boundary(job, boundary + 1, boundary + 1, {"x": 1})


def test_begin_boundary_land_order_for_k_3():
    pipe, job, log = make(k=3)
    pipe.begin(job, 5, 5, {"x": 1})
    pipe.land(job, job.window_step(5))
    pipe.boundary(job, 6, 6, {"x": 1})
    pipe.land(job, job.window_step(6))
    assert job.state is State.CAPTURING
    pipe.boundary(job, 7, 7, {"x": 1})  # the boundary of F
    pipe.land(job, job.window_step(7))
    assert log == [("enqueue", 1), ("land", 1), ("enqueue", 2), ("land", 2),
                   ("freeze", 7, {"x": 1}), ("digest",), ("copy at F",), ("open",), ("blocks final", 0), ("enqueue", 3), ("land", 3),
                   ("write captured",), ("barrier",), ("queue persist",)]
    assert job.state is State.STAGED and job.handle.progress.staged.is_set()
    # blocked time is charged by the Checkpointer around whole hooks (test_checkpointer)


def test_k_1_freezes_at_the_boundary_that_starts_it():
    pipe, job, log = make(k=1)
    run_window(pipe, job)
    assert log[:6] == [("freeze", 5, {"x": 1}), ("digest",), ("copy at F",), ("open",),
                       ("blocks final", 0), ("enqueue", 1)]
    assert job.state is State.STAGED


def test_sync_copies_everything_at_begin_and_leaves_the_persist_to_the_hook():
    pipe, job, log = make(mode="sync", k=1)
    pipe.begin(job, 5, 5, None)
    # the Checkpointer persists it inline once save_checkpoint has charged its time
    assert log == [("freeze", 5, None), ("digest",), ("copy at F",), ("enqueue", 1),
                   ("copy_rest",)]
    assert job.state is State.STAGED


def test_async_copies_everything_at_begin_and_checks_and_persists_in_the_background():
    pipe, job, log = make(mode="async", k=1)
    pipe.begin(job, 5, 5, None)
    assert log == [("freeze", 5, None), ("digest",), ("copy at F",), ("open",),
                   ("blocks final", 0), ("enqueue", 1), ("copy_rest",),
                   ("write captured",), ("call",)]
    assert job.state is State.CAPTURED  # checked against the live state off the hook
    pipe.persister.calls.pop()()
    assert log[-1] == ("persist inline",) and job.state is State.STAGED


@pytest.mark.parametrize("mode,waits_in_step", [("gockpt", True), ("gockpt-o", False)])
def test_record_gradients_where_the_mode_waits(mode, waits_in_step):
    pipe, job, log = make(mode=mode, k=3)
    ticket = pipe.record_gradients(job, 1, (0,), grad_pool=None)
    if waits_in_step:
        assert ticket is None and log == [("gradients", 1), ("grad wait",), ("replay", 1)]
    else:
        assert ticket is not None and log == [("gradients", 1), ("replay", 1)]
        ticket.wait()


def test_a_failure_at_a_boundary_is_raised_once_and_fails_the_job():
    boom = RuntimeError("host copy exploded")
    pipe, job, log = make(k=3, fail={("enqueue", 2): boom})
    loop = Loop()
    job.on_fail = loop.job_failed
    pipe.begin(job, 5, 5, None)
    pipe.land(job, 1)
    with pytest.raises(CheckpointFailedError, match="checkpoint of step 7 failed at the step "
                       "boundary: host copy exploded") as info:
        pipe.boundary(job, 6, 6, None)
    assert info.value.__cause__ is boom and info.value.final_step == 7
    assert job.error is boom and job.state is State.FAILED
    loop.raise_pending()  # already raised: not again at the next hook
    pipe.land(job, 3)  # even the last landing does not move a failed job on
    assert ("barrier",) not in log and ("queue persist",) not in log


def test_a_gockpt_error_at_a_boundary_is_raised_as_itself():
    refused = ConfigError("cannot store the state of step 7")
    pipe, job, log = make(k=3, fail={"freeze": refused})
    pipe.begin(job, 5, 5, None)
    pipe.boundary(job, 6, 6, None)
    with pytest.raises(ConfigError) as info:
        pipe.boundary(job, 7, 7, None)
    assert info.value is refused and job.error is refused and job.reported


def test_a_failure_at_begin_is_raised_as_could_not_start():
    pipe, job, log = make(k=2, fail={("enqueue", 1): OSError("no memory")})
    with pytest.raises(CheckpointFailedError, match="checkpoint at step 5 could not start"):
        pipe.begin(job, 5, 5, None)
    assert job.state is State.FAILED


def test_a_failed_landing_fails_the_job_without_raising():
    pipe, job, log = make(k=2, fail={("land", 2): RuntimeError("copy failed")})
    pipe.begin(job, 5, 5, None)
    pipe.land(job, 1)
    pipe.boundary(job, 6, 6, None)
    pipe.land(job, 2)
    assert str(job.error) == "copy failed" and not job.reported
    assert ("barrier",) not in log


def test_an_optimizer_state_replaced_before_F_fails_the_job_without_raising():
    pipe, job, log = make(k=3, fail={"replaced": ["w", "b"]})
    pipe.begin(job, 5, 5, None)
    pipe.land(job, 1)
    pipe.boundary(job, 6, 6, None)
    pipe.land(job, 2)
    pipe.boundary(job, 7, 7, None)  # F: nothing frozen, the last group not queued
    assert isinstance(job.error, ConsistencyError) and job.error.adapt is Adaptation.NEW_STATE
    assert "optimizer state of w, b was replaced" in str(job.error) and not job.reported
    assert ("freeze", 7, None) not in log and ("enqueue", 3) not in log


def test_the_checkpoint_takes_the_step_and_name_given_at_F():
    pipe, job, log = make(k=2)
    pipe.begin(job, 5, 5, None)
    pipe.boundary(job, 60, 6, None)  # step numbers that are not consecutive
    assert job.handle.final_step == 60 and job.handle.path == "/ck/step-60"
    pipe, job, log = make(k=2)
    pipe.begin(job, 5, 5, None)
    pipe.boundary(job, 6, 6, None, name="global_step6")
    assert job.handle.final_step == 6
    assert job.handle.path == os.path.join(pipe.config.directory, "global_step6")


def test_a_real_checkpointer_raises_a_boundary_failure_once(tmp_path, monkeypatch):
    real = Capture.enqueue_group

    def fails_at_group_2(self, job, j):
        if j == 2:
            raise RuntimeError("injected at group 2")
        return real(self, job, j)

    monkeypatch.setattr(Capture, "enqueue_group", fails_at_group_2)
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             scheduler=sched, block_bytes=4096)
    with pytest.raises(CheckpointFailedError, match="injected at group 2"):
        H.train_steps(model, opt, sched, 0, 4, ck, at={4})  # raised at the boundary of 4
    H.train_steps(model, opt, sched, 4, 7, ck)  # not raised again
    monkeypatch.setattr(Capture, "enqueue_group", real)
    H.train_steps(model, opt, sched, 7, 12, ck, at={11})
    ck.close()
    assert storage.list_checkpoints(str(tmp_path)) == ["step-000000011"]
