"""What the Checkpointer does inside the optimizer's own step, and what the training thread's
time in gockpt is charged to.

:class:`StepHooks` are the optimizer's step pre- and post-hooks: right before the update the
gradients are exactly what it consumes, so a replay records them there (for the blocks
captured so far); right after it (gockpt-o), nothing may change a gradient whose copy has not
landed.  :class:`BlockedTime` charges the time each hook takes to the checkpoint whose window
it runs in (``metrics.jsonl``'s ``blocked_s`` and its parts).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

from .core.errors import Adaptation, ConsistencyError, HookOrderError
from .core.job import Job
from .core.planning import stepped_groups
from .core.staging import HostStaging
from .loop import UPDATE, Loop
from .pipeline import Pipeline


class BlockedTime:
    """``with blocked("update_begin"):`` charges the time of the block to the checkpoint in
    its window (or to the one the block starts); ``current`` gives that checkpoint.

    A plain context object, not a generator-based one: it runs around every hook, and after a
    training step each distinct call on the hooks' path costs microseconds."""

    def __init__(self, current: Callable[[], Optional[Job]]):
        self._current = current

    def __call__(self, hook: str) -> "_Charge":
        return _Charge(self._current, hook)


class _Charge:
    """One block of :class:`BlockedTime`. Parts that inner code charged under their own name
    (e.g. the busy wait) are not counted twice."""

    __slots__ = ("current", "hook", "entry", "job", "before", "t0")

    def __init__(self, current: Callable[[], Optional[Job]], hook: str):
        self.current, self.hook = current, hook

    def __enter__(self) -> None:
        self.entry = entry = self.current()
        self.job = job = entry if entry is not None and entry.capturing else None
        self.before = job.metrics.blocked_s if job is not None else 0.0
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.t0
        now, job, before = self.current(), self.job, self.before
        if now is not self.entry:  # (not one out of its window at the start: its metrics are final)
            job, before = now, 0.0  # started by this hook
        if job is not None:
            inner = job.metrics.blocked_s - before
            job.metrics.add_blocked(self.hook, max(0.0, elapsed - inner))
            if not job.capturing:
                job.accounts_closed.set()  # its window is over: the metrics are final


class StepHooks:
    """The optimizer's step pre-/post-hooks, registered until :meth:`remove`.

    ``current`` gives the checkpoint in its window; ``replays``: whether the mode replays
    (gradients are recorded only then); ``staging`` holds the gradient pool."""

    def __init__(self, optimizer, loop: Loop, current: Callable[[], Optional[Job]],
                 pipeline: Pipeline, staging: HostStaging, device, replays: bool,
                 blocked: BlockedTime, steplog=None):
        self.optimizer, self.loop, self.current = optimizer, loop, current
        self.steplog = steplog  # the memory tier's step log (gockpt.steplog), or None
        self.pipeline, self.staging, self.device = pipeline, staging, device
        self.replays, self.blocked = replays, blocked
        self._tickets: List = []  # gradient copies in flight (gockpt-o)
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before_step(self, optimizer, args, kwargs) -> None:
        """The gradients are exactly what this update consumes."""
        with self.blocked("optimizer_step"):
            self._record_gradients()
        if self.steplog is not None and self.loop.phase == UPDATE:
            self.steplog.consumed()

    def _record_gradients(self) -> None:
        job = self.current()
        if self.loop.phase != UPDATE:
            msg = (f"optimizer.step() ran in phase '{self.loop.phase}': call "
                   "ck.update_begin() after backward and before optimizer.step()")
            self.loop.hook_error(msg)
            if job is not None and job.capturing:
                job.fail_reported(HookOrderError(msg))  # reported by the HookOrderError itself
            return
        if job is None or not job.capturing or job.error is not None:
            return
        groups = stepped_groups(job.plan.fingerprint, self.optimizer)
        if groups is None:
            job.fail(ConsistencyError(
                "the optimizer's parameters changed during the checkpoint (add_param_group, or a "
                "param group's list edited)", adapt=Adaptation.REPLAN))
            return
        if not self.replays:
            return
        j = job.window_step(self.loop.boundary)
        if j < job.k:  # the update of window step K produces F + 1: not needed
            ticket = self.pipeline.record_gradients(job, j, groups, self.staging.grad_pool)
            if ticket is not None:
                self._tickets.append(ticket)

    def _after_step(self, optimizer, args, kwargs) -> None:
        """gockpt-o: the update overlapped the gradient copies; nothing that runs after it (an
        in-place zero_grad, another backward accumulating into .grad) may change a gradient
        before its copy has landed. On a GPU the compute stream waits for the copies (the CPU
        goes on); on the CPU this thread waits."""
        if self._tickets:
            with self.blocked("optimizer_step"):
                self.wait_copies()

    def wait_copies(self) -> None:
        """Order what follows after the gradient copies in flight (a failure fails the
        checkpoint in its window)."""
        tickets, self._tickets = self._tickets, []
        for t in tickets:
            try:
                self.device.order_after(t)
            except BaseException as exc:
                job = self.current()
                if job is not None:
                    job.fail(exc)
