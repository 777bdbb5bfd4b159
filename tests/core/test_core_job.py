"""gockpt.core.job: the states of one checkpoint, its window arithmetic, and how it fails."""

from __future__ import annotations

import pytest

from gockpt.core.errors import CheckpointFailedError, StorageError
from gockpt.core.job import CheckpointHandle, Job, State


def new_job(start_step=10, k=3, start_boundary=10):
    return Job(start_step, k, start_boundary, [[] for _ in range(k)], "gockpt-o", "/ck/x")


class Writer:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


def test_a_job_moves_capturing_captured_staged_durable():
    job = new_job()
    h = job.handle
    assert job.state is State.CAPTURING and job.capturing
    assert (h.final_step, job.metrics.start_step, job.metrics.final_step) == (12, 10, 12)
    assert not h.progress.staged.is_set() and not h.done()
    job.captured()
    assert job.state is State.CAPTURED and not job.capturing
    job.staged()
    assert job.state is State.STAGED
    h.wait_staged(0)  # returns: version F is in host memory
    assert not h.done()
    job.durable("/ck/step-000000012")
    assert job.state is State.DURABLE and h.done() and h.path == "/ck/step-000000012"
    h.wait(0)
    assert "durable" in repr(h)


def test_captured_and_staged_do_not_revive_a_failed_job():
    job = new_job()
    job.fail(RuntimeError("x"))
    job.captured()
    job.staged()
    assert job.state is State.FAILED


def test_first_error_wins_releases_both_events_aborts_writer_calls_on_fail_once():
    job = new_job()
    calls = []
    job.on_fail = calls.append
    writer = job.stream.writer = Writer()
    first, second = StorageError("disk full"), RuntimeError("later")
    job.fail(first)
    job.fail(second)
    assert job.error is first and job.handle.error is first
    assert job.state is State.FAILED
    assert job.handle.progress.staged.is_set() and job.handle.done()
    assert writer.aborted == 1 and calls == [job]
    assert not job.reported


def test_fail_reported_marks_the_error_as_reported():
    job = new_job()
    job.fail_reported(RuntimeError("raised right away"))
    assert job.reported and job.state is State.FAILED


def test_handle_wait_reraises_as_checkpoint_failed():
    job = new_job()
    cause = StorageError("No space left on device")
    job.fail(cause)
    for wait in (job.handle.wait, job.handle.wait_staged):
        with pytest.raises(CheckpointFailedError, match="checkpoint of step 12 failed: No space") \
                as info:
            wait(0)
        assert info.value.__cause__ is cause and info.value.final_step == 12
    assert job.reported
    assert "failed" in repr(job.handle)


def test_drop_abandons_the_job():
    job = new_job()
    writer = job.stream.writer = Writer()
    calls = []
    job.on_fail = calls.append
    job.drop()
    assert job.state is State.DROPPED and job.dropped and not job.capturing
    assert writer.aborted == 1 and calls == []
    assert job.reported and job.handle.done() and job.handle.progress.staged.is_set()
    with pytest.raises(CheckpointFailedError, match="dropped"):
        job.handle.wait(0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_window_arithmetic(k):
    job = new_job(start_step=20, k=k, start_boundary=7)
    assert job.f_boundary == 7 + k - 1
    assert job.handle.final_step == 20 + k - 1
    assert [job.window_step(b) for b in range(7, 7 + k)] == list(range(1, k + 1))
    assert [b for b in range(0, 20) if job.is_final_boundary(b)] == [7 + k - 1]
    # the step after the last boundary of the window lands group K
    assert job.window_step(job.f_boundary) == k


def test_renamed_takes_the_step_passed_at_F():
    job = new_job()
    job.renamed(15, "/ck/step-000000015")
    assert job.handle.final_step == job.metrics.final_step == 15
    assert job.handle.path == "/ck/step-000000015"


def test_handle_repr_in_flight():
    h = CheckpointHandle(3, "/ck/p")
    assert "in flight" in repr(h) and "final_step=3" in repr(h)
