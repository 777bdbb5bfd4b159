"""gockpt.loop: which hook may come next, and background errors raised at the next hook."""

from __future__ import annotations

import pytest

from gockpt.core.errors import CheckpointFailedError, HookOrderError, StorageError
from gockpt.core.job import Job
from gockpt.loop import BACKWARD, IDLE, UPDATE, Loop


def failed_job(final_step, message="disk full"):
    job = Job(final_step, 1, 0, [[]], "async", "x")
    job.fail(StorageError(message))
    return job


def test_hooks_in_order_pass():
    loop = Loop()
    for hook, phase, after in (("backward_begin", IDLE, BACKWARD),
                               ("update_begin", BACKWARD, UPDATE)):
        loop.expect(hook, phase)
        loop.phase = after


@pytest.mark.parametrize("hook,phase,now", [("update_begin", BACKWARD, IDLE),
                                             ("update_begin", BACKWARD, UPDATE),
                                             ("backward_begin", IDLE, UPDATE)])
def test_a_hook_out_of_order_says_what_the_order_is(hook, phase, now):
    loop = Loop()
    loop.phase = now
    with pytest.raises(HookOrderError) as info:
        loop.expect(hook, phase)
    msg = str(info.value)
    assert f"{hook}() called in phase '{now}'" in msg
    assert "backward_begin(), loss.backward(), update_begin(), optimizer.step(), " \
           "save_checkpoint(step)" in msg


def test_backward_begin_again_after_an_abandoned_backward():
    loop = Loop()
    loop.phase = BACKWARD  # loss.backward() raised; the step is started afresh
    loop.expect("backward_begin", IDLE)


def test_backward_begin_again_after_a_gockpt_error():
    loop = Loop()
    loop.phase = UPDATE
    loop.job_failed(failed_job(4))
    with pytest.raises(CheckpointFailedError):
        loop.raise_pending()
    loop.expect("backward_begin", IDLE)  # allowed once, after the error
    with pytest.raises(HookOrderError):
        loop.expect("backward_begin", IDLE)  # the allowance is used up


def test_raise_pending_reports_a_failed_job_once():
    loop = Loop()
    job = failed_job(4)
    loop.job_failed(job)
    with pytest.raises(CheckpointFailedError, match="step 4 failed: disk full; the previous "
                       "checkpoint stays latest") as info:
        loop.raise_pending()
    assert info.value.final_step == 4 and info.value.__cause__ is job.error
    assert job.reported
    loop.raise_pending()  # nothing left


def test_raise_pending_skips_jobs_already_reported():
    loop = Loop()
    by_wait, by_hook = failed_job(4), failed_job(8)
    with pytest.raises(CheckpointFailedError):
        by_wait.handle.wait(0)
    by_hook.fail_reported(by_hook.error)
    loop.job_failed(by_wait)
    loop.job_failed(by_hook)
    loop.raise_pending()


def test_raise_pending_reports_each_failed_job():
    loop = Loop()
    first, second = failed_job(4, "first"), failed_job(8, "second")
    loop.job_failed(first)
    loop.job_failed(second)
    with pytest.raises(CheckpointFailedError, match="step 4"):
        loop.raise_pending()
    with pytest.raises(CheckpointFailedError, match="step 8"):
        loop.raise_pending()


def test_a_misuse_seen_outside_a_hook_is_raised_at_the_next_one_first():
    loop = Loop()
    loop.job_failed(failed_job(4))
    loop.hook_error("optimizer.step() ran in phase 'idle'")
    with pytest.raises(HookOrderError, match="optimizer.step"):
        loop.raise_pending()
    with pytest.raises(CheckpointFailedError, match="step 4"):
        loop.raise_pending()


def test_closed_loop_refuses_hooks():
    loop = Loop()
    loop.check_open()
    loop.closed = True
    with pytest.raises(HookOrderError, match="closed"):
        loop.check_open()
