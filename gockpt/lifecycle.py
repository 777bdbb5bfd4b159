"""How a :class:`~gockpt.checkpointer.Checkpointer` ends, and what waiting for it completes.

:class:`Lifecycle` is the Checkpointer's second half (its base class): ``wait`` (completing a
checkpoint asked at the last step reached, from the training thread or from any thread once
that one has ended), ``close`` (finishing what the tiers owe at the end of training), ``abort``
(a process leaving on an exception: nothing waits for the other ranks), the interpreter's exit,
the remote tier's waits, and ``with``. It starts nothing: the hooks and the window are
checkpointer.py's; it reads the parts that module builds (``loop``, ``pipeline``, ``capture``,
``tiers``, ``ranks``, ...).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Optional

from .core.errors import CheckpointFailedError, GockptError
from .core.job import Job
from .exit import forget_at_exit
from .loop import UPDATE
from .storage.replicate import RemoteStatus

log = logging.getLogger("gockpt")


class Lifecycle:
    """The end of a Checkpointer's life and the waits on it (see the module's docstring)."""

    def wait(self) -> None:
        """Block until the last checkpoint asked for is durable (completing its copy now if
        training has not reached the step that would carry it); re-raise background errors.
        A window started for a checkpoint not asked for yet is not waited for."""
        last = self._last_asked
        if last is not None:
            self._complete_on_wait(last)
            last.progress.durable.wait()
        self.loop.raise_pending()

    def _watch(self, job: Job) -> None:
        """Give ``job``'s handle what its waits call (completing its copy, saying what it
        waits for), through a weak reference: a job that has ended is freed at once by its
        reference count, not left in a cycle (job -> its progress -> these -> job) for the
        garbage collector -- its full passes over a training process's objects stalled the
        training thread for 0.1-0.2 s every few checkpoints of 1,000 tensors."""
        ref = weakref.ref(job)

        def on_wait() -> None:
            live = ref()
            if live is not None:
                self._complete_on_wait(live)

        def pending() -> str:
            live = ref()
            return self._pending(live) if live is not None else "nothing: it has ended"
        job.progress.on_wait, job.progress.pending = on_wait, pending

    def _complete_on_wait(self, job: Job) -> None:
        """``job`` was asked for and is still being copied: copy the rest now, while the state
        is still the one of its step (no update since: in phase IDLE or BACKWARD), on the
        training thread -- or on any thread once that thread has ended (no hook can run
        beside it any more; the device's queued work is waited for first). From another thread
        while the loop runs, the training loop completes it."""
        loop_ended = not self._loop_thread.is_alive()
        if not (job.capturing and job.error is None and self._job is job
                and self.loop.boundary >= job.f_boundary and self.loop.phase != UPDATE
                and (threading.current_thread() is self._loop_thread or loop_ended)):
            return
        with self._completing:  # (several waiting threads: one completes it)
            if not job.capturing or job.error is not None:
                return
            if loop_ended:
                self.device.settle()  # the ended thread's queued work
            with self._blocked("wait"):
                self.capture.copy_rest(job)
                job.accounts_closed.set()
                self.pipeline.finish_capture(job)

    def _pending(self, job: Job) -> str:
        """Any thread: what ``job`` still waits for, in words."""
        if job.capturing:
            return (f"its last copies, which the training loop's thread "
                    f"({self._loop_thread.name!r}) makes at its next update_begin() or close()")
        if not job.progress.staged.is_set():
            return "the optimizer replay of its window (thread gockpt-replay)"
        return "its writes and commit (thread gockpt-persist)" + (
            ", with the other ranks'" if self.ranks.several else "")

    def close(self) -> None:
        """Finish or drop in-flight work, stop every thread, and re-raise background errors.

        A checkpoint whose version F has been reached is completed (waiting until durable);
        one that still needed training steps is dropped with a warning, nothing of it visible.
        The memory tier's copies are removed (the end of training: the disk holds them).
        """
        self._close(end_of_training=True)

    def _close(self, end_of_training: bool) -> None:
        """:meth:`close`; ``end_of_training`` false: the process is leaving on an uncaught
        exception, and the memory tier's copy is what its restart loads."""
        if self.loop.closed:
            return
        self.loop.closed = True
        forget_at_exit(self)
        job = self._job
        try:
            if job is not None and job.capturing and job.error is None:
                if job is self._last_asked:  # its step was reached: complete it now
                    self._complete_on_wait(job)
                if job.capturing:  # a window for a step not reached: nothing was asked yet
                    log.info("gockpt: close() before step %d: the checkpoint planned for it "
                             "is dropped", job.handle.final_step)
                    job.drop()
            self._step_hooks.wait_copies()
            self.pipeline.close()
            if self.steplog is not None:
                self.steplog.close()
            self.tiers.finish(end_of_training)
        finally:
            self._stop()
        self._progress.end()  # (a killed process records none)
        self.loop.raise_pending()

    def abort(self) -> None:
        """Stop now, abandoning the checkpoint in flight (nothing of it becomes visible; the
        previous ``latest`` stays) without waiting for the other ranks; background errors are
        logged, not raised.

        What a process leaving on an exception needs on several ranks, and what gockpt calls
        then (``with`` left by an exception, or the interpreter exiting on an uncaught one):
        committing the checkpoint in flight would need the other ranks, and they may be
        waiting for this rank in a training collective it never joins -- the job would hang
        instead of ending, and a hung job is never restarted by its launcher. The other ranks'
        copies of that checkpoint fail (not committed) when this process is gone.
        """
        if self.loop.closed:
            return
        self.loop.closed = True
        forget_at_exit(self)
        self.ranks.abandon()  # every collective of ours gives up, waiting or to come
        job = self._job
        try:
            if job is not None and job.error is None and not job.progress.durable.is_set():
                log.warning("gockpt: the checkpoint of step %d is abandoned (the process is "
                            "leaving); the previous checkpoint stays the latest",
                            job.handle.final_step)
                if job.capturing:
                    job.drop()
                else:
                    job.fail(CheckpointFailedError(
                        f"checkpoint of step {job.handle.final_step} abandoned: the process "
                        "is leaving"))
            self._step_hooks.wait_copies()
            self.pipeline.close()
        finally:
            self._stop()
        try:
            self.loop.raise_pending()
        except GockptError as err:
            log.info("gockpt: after abandoning: %s", err)

    def close_at_exit(self, failing: bool) -> None:
        """The interpreter is ending with this Checkpointer open (``gockpt.exit``; ``failing``:
        on an uncaught exception): :meth:`close` -- or, on several ranks, :meth:`abort` when
        failing or when some rank did not reach its own exit within ``Config.exit_wait_s``."""
        if self.ranks.several and not self.loop.closed:
            try:
                everyone = not failing and self.ranks.agree_all(
                    True, timeout=self.config.exit_wait_s) is not None
            except Exception as exc:  # noqa: BLE001 -- e.g. the process group destroyed
                log.warning("gockpt: at exit, the ranks could not agree to close: %s", exc)
                everyone = False
            if not everyone:
                self.abort()
                return
        self._close(end_of_training=not failing)

    def _stop(self) -> None:
        """Stop every thread and let go of every resource (the end of close and abort)."""
        self.tiers.stop()
        if self.steplog is not None:
            self.steplog.close()
        self.staging.close()
        self.engine.close()
        if self.digester is not None:
            self.digester.close()
        self.lock.release()
        self._step_hooks.remove()
        if self.adapter is not None:
            self.adapter.close()
        self.ranks.close()  # our groups' workers joined while the interpreter is whole

    def wait_remote(self, timeout: Optional[float] = None) -> Optional[RemoteStatus]:
        """Wait until the last checkpoint asked for is committed (:meth:`wait`) and every
        committed checkpoint is in the remote store (at most ``timeout`` seconds for the
        latter) and say how far the remote tier got (``None`` without one, and
        on ranks other than 0, which upload nothing). Does not raise for a failing store: the
        status names its last error."""
        if self.tiers.remote is None:
            return None
        self.wait()  # the last checkpoint asked for is committed (and so queued) first
        return self.tiers.wait_remote(timeout)

    def remote_status(self) -> Optional[RemoteStatus]:
        """How far the remote tier got, without waiting (see :meth:`wait_remote`)."""
        return self.tiers.remote_status()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and self.ranks.several:
            self.abort()  # leaving on an exception: never wait for the other ranks
            return
        try:
            self.close()
        except GockptError as err:
            if exc_type is None:
                raise
            log.error("gockpt: while closing after an exception: %s", err)  # (theirs shows)
