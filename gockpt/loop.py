"""The training loop as the Checkpointer sees it: which hook may come next, and the errors of
background threads waiting to be raised at the next hook.

Each step calls, in this order::

    backward_begin()   loss.backward()   update_begin()   optimizer.step()   save_checkpoint(step)

Recovery: after a gockpt error has been raised, or after ``loss.backward()`` raised between
``backward_begin()`` and ``update_begin()``, the step may be abandoned: ``backward_begin()`` may
be called again.
"""

from __future__ import annotations

import enum
import threading
import warnings
from typing import List, Optional, Set

from .core.errors import (Adaptation, CheckpointFailedError, ConsistencyError, GockptError,
                          HookOrderError, UnsupportedOptimizerError)

class Phase(enum.Enum):
    """Where the training thread is in its step (what the last hook said)."""

    IDLE = "idle (after save_checkpoint)"
    BACKWARD = "backward"
    UPDATE = "update"

    def __str__(self) -> str:  # as messages name it
        return self.value


IDLE, BACKWARD, UPDATE = Phase.IDLE, Phase.BACKWARD, Phase.UPDATE


# What the next checkpoints do, as the warning says it.
_NEXT = {Adaptation.COPY_AT_F: "From now on these tensors are copied directly at the step "
                               "boundary of each checkpoint",
         Adaptation.REPLAN: "The next one is planned for the optimizer's new parameters",
         Adaptation.NEW_STATE: "The next one reads the optimizer's new state"}


class Loop:
    """Phase of the loop and errors pending for the training thread."""

    def __init__(self):
        self.phase = IDLE
        self.boundary = 0          # save_checkpoint calls so far
        self.steps_seen = 0        # completed training steps (boundaries after an update)
        self.closed = False
        self._after_error = False
        self._hook_error: Optional[str] = None
        self._failed: List = []    # jobs failed in the background, not reported yet
        self._adapted: Set[str] = set()  # slots to copy at F from the next checkpoint on
        self._warnings: List[str] = []
        self._lock = threading.Lock()

    def enter(self, hook: str, expected: Phase, phase: Phase) -> None:
        """``hook`` was called: the loop must be open and in ``expected``; it is now in
        ``phase``."""
        self.check_open()
        self.expect(hook, expected)
        self.phase = phase

    def reach_boundary(self, step: int) -> bool:
        """``save_checkpoint(step)``: the step boundary. Returns whether a training step
        completed (False: the boundary before the first step)."""
        if self.phase is not UPDATE and not (self.phase is IDLE and self.steps_seen == 0):
            raise HookOrderError(
                f"save_checkpoint({step}) called in phase '{self.phase}'; call it once per "
                "step, after update_begin() and optimizer.step()")
        completed = self.phase is UPDATE
        self.steps_seen += completed
        self.boundary += 1
        self.phase = IDLE
        return completed

    def expect(self, hook: str, phase: Phase) -> None:
        """Raise HookOrderError unless the loop is in ``phase``."""
        after_error, self._after_error = self._after_error, False
        if hook == "backward_begin" and (after_error or self.phase == BACKWARD):
            return  # the previous step was abandoned (an error, or backward raised): afresh
        if self.phase != phase:
            raise HookOrderError(
                f"{hook}() called in phase '{self.phase}'; each step calls backward_begin(), "
                "loss.backward(), update_begin(), optimizer.step(), save_checkpoint(step) in "
                "this order")

    def check_open(self) -> None:
        if self.closed:
            raise HookOrderError("this Checkpointer is closed; create a new one to continue")

    def hook_error(self, message: str) -> None:
        """A misuse seen outside a hook (e.g. in the optimizer's step): raised at the next one."""
        self._hook_error = message

    def job_failed(self, job, retaken: bool = False) -> None:
        """Any thread: ``job`` failed. Its error is raised at the next hook -- unless it found
        tensors written outside the optimizer, or the optimizer's parameters or state changed:
        then the next checkpoints adapt, and a warning says so once (``handle.wait()`` still
        raises). ``retaken``: it failed in its window, before its step, which is then taken
        anew when it is reached."""
        if retaken and isinstance(job.error, UnsupportedOptimizerError):
            job.mark_reported()  # training goes on; the checkpoint is still taken at its step
            step = job.handle.final_step
            self.adapt((), f"gockpt: the replay cannot follow this optimizer ({job.error}); "
                       f"step {step} and the checkpoints after it are copied at their step "
                       "(as async-o does) instead of over the steps before it")
            return
        adapt = job.error.adapt if isinstance(job.error, ConsistencyError) else None
        if adapt is not None:
            job.mark_reported()
            outside = sorted(job.error.tensors) if adapt is Adaptation.COPY_AT_F else []
            what = _NEXT[adapt]
            step = job.handle.final_step
            self.adapt(outside, f"gockpt: the copies of the checkpoint of step {step} were "
                       f"refused: {job.error}. {what}; step {step} is copied at once when it "
                       "is reached" if retaken else f"gockpt: the checkpoint of step {step} "
                       f"was not committed: {job.error}. {what}")
            return
        with self._lock:
            self._failed.append(job)

    def adapt(self, names, warning: str) -> None:
        """Any thread: a checkpoint was not committed for a reason the next ones adapt to
        (``names`` found written outside the optimizer: copied at F from now on; none for
        changed optimizer parameters or state); ``warning`` is issued at the next hook."""
        with self._lock:
            self._adapted.update(names)
            self._warnings.append(warning)

    def take_adapted(self) -> Set[str]:
        """The slot names to copy at F from now on (training thread, at a checkpoint start)."""
        with self._lock:
            names, self._adapted = self._adapted, set()
        return names

    def raise_pending(self) -> None:
        """Issue pending warnings, then raise the first error not reported yet (training
        thread)."""
        if not (self._warnings or self._hook_error or self._failed):
            return  # (the usual case, read without the lock: what another thread adds after
            # this read is raised at the next hook, as after the lock's swap below)
        with self._lock:
            notes, self._warnings = self._warnings, []
        for note in notes:
            warnings.warn(note, stacklevel=3)
        try:
            self._raise_pending()
        except GockptError:
            self._after_error = True
            raise

    def _raise_pending(self) -> None:
        if self._hook_error:
            msg, self._hook_error = self._hook_error, None
            raise HookOrderError(msg)
        with self._lock:
            pending = [j for j in self._failed if not j.reported]
            self._failed = pending[1:]  # the others at the next hooks, one each
        if pending:
            job = pending[0]
            job.mark_reported()
            raise CheckpointFailedError(
                f"checkpoint of step {job.handle.final_step} failed: {job.error}; the previous "
                "checkpoint stays latest", job.handle.final_step) from job.error
