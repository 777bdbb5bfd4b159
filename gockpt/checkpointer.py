"""The training-loop hooks and the life of one checkpoint (see docs/architecture.md).

A checkpoint is the state of the step F it was asked for (``save_checkpoint(F)`` with an
``interval`` dividing F, or forced). When F is known in advance (the interval, or the learned
spacing of forced saves), the replay modes start its window K - 1 steps early, at boundary
N = F - K + 1; a checkpoint asked for without notice is a window of one step (N = F):

    boundary N     queue copies of group 1 (the copy thread runs them under step N+1's fwd/bwd)
    step N+j       update_begin waits for group j (version N+j-1); the optimizer's step pre-hook
                   records the gradients of step N+j for the blocks captured so far (j < K)
    boundary F     capture everything small (buffers, scheduler, RNG, step, extra state)
    step N+K       update_begin waits for the last group (version F): all blocks captured
    background     replay brings every block to F -> self-check -> write -> commit

This module decides *when* (the hooks, starting, errors); :mod:`gockpt.core.modes` says what each
mode does, :mod:`gockpt.schedule` when a checkpoint is due and its K, and each pipeline stage
lives in its own package: ``capture/`` -> ``replay/`` -> ``storage/``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Callable, List, Optional, Union

import torch

from . import storage
from .capture.copies import Capture
from .core.digest import LiveDigests
from .capture.device import device_for
from .core.names import is_replicated
from .core.plan import build_plan, check_layouts, fingerprint, stepped_groups
from .core.staging import GradPool, HostCopy, StagingAllocation, planned_host_bytes
from .capture.transfer import CopyEngine
from .capture.transport import Bf16Transport
from .core.config import Config
from .core.errors import (ConfigError, ConsistencyError, GockptError, HookOrderError,
                     UnsupportedOptimizerError)
from .core.job import CheckpointHandle, Job
from .loop import BACKWARD, IDLE, UPDATE, Loop
from .replay.adapters import adapter_for
from .replay.replayer import Replayer
from .pipeline import Pipeline
from .schedule import Schedule
from .storage.commit import check_new_name, cleanup_temporaries, ensure_writable
from .storage.lock import lock_for_ranks
from .storage.persist import Persister
from .storage.ranks import Ranks

log = logging.getLogger("gockpt")


class Checkpointer:
    """Checkpoints a model and its optimizer without stopping training for the state copy.

    Call the three hooks every step (see docs/architecture.md)::

        ck.backward_begin(); loss.backward(); ck.update_begin()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        handle = ck.save_checkpoint(step + 1)

    Args:
        model: the ``torch.nn.Module`` being trained.
        optimizer: its optimizer. The gockpt modes need ``torch.optim.Adam``/``AdamW`` (refused
            otherwise with :class:`~gockpt.core.errors.UnsupportedOptimizerError`).
        directory: where checkpoints go (created if missing).
        mode: ``"sync" | "async" | "async-o" | "gockpt" | "gockpt-o"`` (:mod:`gockpt.core.modes`).
        overlap_steps: K for the gockpt modes; ``None`` measures and chooses.
        scheduler: optional LR scheduler, saved at version F.
        interval: start a checkpoint every ``interval`` steps (``None``: only when forced;
            ``"auto"`` with ``mtbf=SECONDS``: the Young/Daly optimum, re-measured).
        **options: further :class:`~gockpt.core.config.Config` fields (``mtbf``, ``block_bytes``,
            ``self_check``, ``self_check_strict``, ``on_busy``, ``replay_threads``, ...).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 directory: str, mode: str = "gockpt-o", overlap_steps: Optional[int] = None,
                 scheduler=None, interval: Union[int, str, None] = None, **options):
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.config = Config(directory=directory, mode=mode, overlap_steps=overlap_steps,
                             interval=interval, **options)
        self.policy = self.config.policy
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.ranks = Ranks()  # collective on several ranks: every rank builds its Checkpointer
        if self.ranks.several and (self.config.interval == "auto"
                                   or self.config.on_busy == "skip"):
            raise ConfigError("with several ranks every rank must start the same checkpoints: "
                              "use a fixed interval (or force) and on_busy='wait'")
        if self.config.replicated is None:
            self.config.replicated = is_replicated(model)
        self.plan = build_plan(model, optimizer, self.config.block_bytes, self._min_blocks())
        ensure_writable(self.config.directory)
        self.lock = lock_for_ranks(self.config.directory, self.ranks)
        self.adapter = None
        try:
            self.adapter = adapter_for(optimizer) if self.policy.replays else None
            self._build(model, optimizer, scheduler)
        except BaseException:
            self.lock.release()
            if self.adapter is not None:
                self.adapter.close()
            raise
        _close_at_exit(self)

    def _build(self, model, optimizer, scheduler) -> None:
        """Everything that needs the directory lock."""
        cleanup_temporaries(self.config.directory)
        self.planned_host_bytes = planned_host_bytes(self.plan, self.policy.replays, self.config.max_host_bytes)
        self.device = device_for([s.param for s in self.plan.slots])
        if self.config.emulate_link_gbps is not None and self.device.kind != "cpu":
            raise ConfigError("emulate_link_gbps emulates a GPU link for training on the CPU; "
                              f"the parameters live on {self.device.kind}")
        self.engine = CopyEngine(self.device, link_gbps=self.config.emulate_link_gbps)
        self.host: Optional[HostCopy] = None          # taken at the first checkpoint from
        self.grad_pool: Optional[GradPool] = None     # the allocation started here
        self._staging: Optional[StagingAllocation] = self._allocate_staging()
        self.replayer = Replayer(self.adapter, self.config.replay_threads) if self.adapter else None
        transport = Bf16Transport(self.config.grad_multiplier) \
            if self.config.grad_transport == "bf16" and self.adapter is not None else None
        self.capture = Capture(model, optimizer, scheduler, self.engine, self.adapter, transport)
        self.schedule = Schedule(self.config)
        self.persister = Persister(self.config, self.plan, self.ranks, type(optimizer).__name__,
                                   step_time=self.schedule.median_step_time,
                                   host_bytes=lambda: self.host_bytes,
                                   on_durable=lambda job: self.schedule.durable(
                                       job.metrics.blocked_s))
        self.digester = LiveDigests(self.device) if self.config.verify else None
        self.pipeline = Pipeline(self.config, self.capture, self.replayer, self.persister,
                                 lambda step: _checkpoint_path(self.config.directory, step),
                                 self.digester)
        self.loop = Loop()
        self._thread = threading.get_ident()  # the training thread: it builds the Checkpointer
        self._job: Optional[Job] = None
        self._last_asked: Optional[Job] = None  # the last checkpoint whose step was reached
        self._agreed_k = self.config.overlap_steps or 2  # several ranks: K agreed at each F
        self._warned_k = False
        self._windows_off = False  # the replay could not follow: copied at the step from now
        self._grad_tickets: List = []
        self._hooks = [optimizer.register_step_pre_hook(self._on_optimizer_step),
                       optimizer.register_step_post_hook(self._after_optimizer_step)]
        log.info("gockpt: %s mode, %d tensors in %d blocks, %.1f MiB host staging planned",
                 self.config.mode, len(self.plan.slots), len(self.plan.blocks),
                 self.planned_host_bytes / 2**20)

    # ------------------------------------------------------------------ hooks

    def backward_begin(self) -> None:
        """Call right before ``loss.backward()``: gradients are about to change.

        May be called again for the same step when the previous attempt was abandoned
        (``loss.backward()`` raised, or a gockpt error was raised and caught)."""
        self.loop.check_open()
        self.loop.expect("backward_begin", IDLE)
        self.loop.phase = BACKWARD
        self.loop.raise_pending()  # after the transition: a caught error leaves the loop usable

    def update_begin(self) -> None:
        """Call after backward (and clipping/unscaling), right before ``optimizer.step()``:
        this step's state copies must be done before the optimizer changes the state."""
        self.loop.check_open()
        self.loop.expect("update_begin", BACKWARD)
        self.schedule.reached_update()
        with self._charged("update_begin"):
            self.pipeline.before_update()
            job = self._job
            if job is not None and job.capturing and job.error is None:
                self.pipeline.land(job, job.window_step(self.loop.boundary))
        self.loop.phase = UPDATE
        self.loop.raise_pending()

    def save_checkpoint(self, step: int, extra_state: Union[dict, Callable[[], dict], None] = None,
                        *, force: bool = False, name: Optional[str] = None
                        ) -> Optional[CheckpointHandle]:
        """The step boundary: call once at the end of every step, after ``optimizer.step()``
        and ``scheduler.step()``.

        Checkpoints the state of this very step when ``force`` is true, ``interval`` divides
        ``step`` or :meth:`plan_checkpoint` announced it, and returns its handle (otherwise ``None``): the checkpoint is named
        for ``step`` and holds the state right after its update, bit for bit, with
        ``extra_state`` (a dict, or a zero-argument callable called here) as given now --
        tensors, numbers, strings, lists and dicts, stored without pickle. ``name`` names it
        instead (a tag such as DeepSpeed's ``global_step<N>``); it must not exist yet.

        When the step of the next checkpoint is known in advance (``interval``,
        :meth:`plan_checkpoint`, or the spacing of the previous forced saves), the replay modes start copying K - 1 steps
        before it so that the copy rides under training; a checkpoint asked for without
        notice is copied under the next step's forward/backward (as ``async-o``).
        """
        self.loop.check_open()
        if name is not None:
            check_new_name(self.config.directory, name)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"step must be an int, got {step!r}")
        loop = self.loop
        if loop.phase != UPDATE and not (loop.phase == IDLE and loop.steps_seen == 0):
            raise HookOrderError(
                f"save_checkpoint({step}) called in phase '{loop.phase}'; call it once per "
                "step, after update_begin() and optimizer.step()")
        completed = loop.phase == UPDATE
        loop.steps_seen += completed
        self.schedule.reached_boundary(completed)
        loop.boundary += 1
        loop.phase = IDLE
        handle = None
        with self._charged("save_checkpoint"):
            asked = force or self.schedule.due(step)
            job = self._job
            if job is not None and job.capturing and job.error is None:
                if job.is_final_boundary(loop.boundary) and asked:
                    self.pipeline.boundary(job, step, loop.boundary, extra_state, name)
                    handle = self._asked(job, step)
                elif job.is_final_boundary(loop.boundary) or asked:
                    self._drop_window(job, step, asked)  # its step is not the one asked for
                else:
                    self.pipeline.boundary(job, step, loop.boundary, extra_state)
            loop.raise_pending()  # the boundary is recorded; no new checkpoint after a failure
            if asked and handle is None:  # without notice: copied now, F = this step
                handle = self._start(step, 1, extra_state, name)
                if handle is not None:
                    handle = self._asked(self._job, step)
            elif not asked:
                self._maybe_start_window(step)
        if handle is not None and self.policy.persists_inline and self._job.error is None:
            self.persister.persist(self._job)  # sync: the write blocks (and is counted) too
            self.loop.raise_pending()
        self.schedule.boundary_done()
        return handle

    def plan_checkpoint(self, step: int) -> None:
        """Announce a checkpoint at ``step``: a save schedule that is not a fixed interval, or
        the last step of training. ``save_checkpoint(step)`` then takes it without ``force``,
        and the replay modes copy its state over the K steps up to it instead of under the
        step after it (as for a checkpoint asked for without notice)."""
        self.loop.check_open()
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"step must be an int, got {step!r}")
        self.schedule.announce(step)

    def _asked(self, job: Job, step: int) -> CheckpointHandle:
        """``job`` reached the step it was asked for: what ``wait()`` now waits for."""
        self.schedule.asked(step)
        if self.ranks.several and self.config.fixed_overlap_steps() is None:
            self._agreed_k = self.ranks.agree_max(self._measured_k())  # for the next window
        self._last_asked = job
        job.progress.on_wait = lambda: self._complete_on_wait(job)
        return job.handle

    def _drop_window(self, job: Job, step: int, asked: bool) -> None:
        """A window started for a step that was not asked for after all (a save at another
        step, or none at its end): nothing of it is visible."""
        log.info("gockpt: the checkpoint planned for step %d is dropped (%s at step %d)",
                 job.handle.final_step, "a save asked" if asked else "no save", step)
        job.drop()

    def _maybe_start_window(self, step: int) -> None:
        """Start the window of the next expected checkpoint when it must start here: K - 1
        steps before its step, so that it ends at the step asked for."""
        if not self.policy.replays or self._windows_off or (
                self._job is not None and self._job.capturing):
            return
        k = self._window_k()
        if k > 1 and self.schedule.expected(step + k - 1):
            self._start(step, k, None, None)

    def _window_k(self) -> int:
        """K of a window starting now: configured, measured (on several ranks: agreed at the
        last checkpoint), at most the spacing of the saves, at most the blocks to copy."""
        k = self.config.fixed_overlap_steps()
        if k is None:
            k = self._agreed_k if self.ranks.several else self._measured_k()
        spacing = self.schedule.spacing()
        if spacing is not None:
            k = min(k, spacing)
        groups = len(self.plan.groups(k))
        if groups < k and self.config.overlap_steps and not self._warned_k:
            self._warned_k = True
            warnings.warn(f"gockpt: overlap_steps={self.config.overlap_steps} but only "
                          f"{groups} blocks are replayed (the others are copied at the final "
                          f"step): K={groups}", stacklevel=4)
        return groups

    def _measured_k(self) -> int:
        return self.schedule.choose_k(
            self.plan.state_bytes(2), self.plan.optimized_bytes() if self.policy.replays else 0,
            self.engine.bandwidth())

    # ------------------------------------------------------------------ lifecycle

    def wait(self) -> None:
        """Block until the last checkpoint asked for is durable (completing its copy now if
        training has not reached the step that would carry it); re-raise background errors.
        A window started for a checkpoint not asked for yet is not waited for."""
        last = self._last_asked
        if last is not None:
            self._complete_on_wait(last)
            last.progress.durable.wait()
        self.loop.raise_pending()

    def _complete_on_wait(self, job: Job) -> None:
        """``job`` was asked for and is still being copied: copy the rest now, on the training
        thread, while the state is still the one of its step (no update since: in phase IDLE
        or BACKWARD). From another thread, or later, the training loop completes it."""
        if not (job.capturing and job.error is None and self._job is job
                and self.loop.boundary >= job.f_boundary and self.loop.phase != UPDATE
                and threading.get_ident() == self._thread):
            return
        with self._charged("wait"):
            self.capture.copy_rest(job)
            job.accounts_closed.set()
            self.pipeline.finish_capture(job)

    def close(self) -> None:
        """Finish or drop in-flight work, stop every thread, and re-raise background errors.

        A checkpoint whose version F has been reached is completed (waiting until durable);
        one that still needed training steps is dropped with a warning, nothing of it visible.
        """
        if self.loop.closed:
            return
        self.loop.closed = True
        _open.discard(self)
        job = self._job
        try:
            if job is not None and job.capturing and job.error is None:
                if job is self._last_asked:  # its step was reached: complete it now
                    self._complete_on_wait(job)
                if job.capturing:  # a window for a step not reached: nothing was asked yet
                    log.info("gockpt: close() before step %d: the checkpoint planned for it "
                             "is dropped", job.handle.final_step)
                    job.drop()
            self._wait_grad_copies()
            if self.replayer is not None:
                self.replayer.close()
            self.persister.close()
        finally:
            if self._staging is not None:  # never taken: no checkpoint was started
                self._staging.join()
                self._staging = None
            self.engine.close()
            if self.digester is not None:
                self.digester.close()
            self.lock.release()
            for hook in self._hooks:
                hook.remove()
            if self.adapter is not None:
                self.adapter.close()
        self.loop.raise_pending()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except GockptError as err:  # the training error is the one to see
                log.error("gockpt: while closing after an exception: %s", err)

    @property
    def host_bytes(self) -> int:
        """Host memory gockpt holds for staging (state copy + gradient buffers)."""
        n = self.host.nbytes() if self.host else 0
        return n + (self.grad_pool.nbytes() if self.grad_pool else 0)

    # ------------------------------------------------------------------ the window

    def _start(self, step: int, k: int, extra_state, name: Optional[str]
               ) -> Optional[CheckpointHandle]:
        """Start a checkpoint of K steps at this boundary: K = 1 copies the state of ``step``
        (asked for now); K > 1 is the window of the checkpoint expected at ``step + K - 1``.
        None when it does not start (the previous one is still busy and ``on_busy="skip"``;
        a window whose K no longer fits the plan starts at a later boundary)."""
        waited = self._wait_for_previous(step, quiet=k > 1)
        if waited is None:
            return None
        if self._job is not None and self._job.error is not None:
            self.pipeline.settle(self._job)  # its staging is about to be reused
        if fingerprint(self.optimizer) != self.plan.fingerprint:
            self._replan()
        check_layouts(self.plan)
        self.plan.copy_at_f(self.loop.take_adapted())
        groups, tables = self.plan.groups(k), self.plan.group_tables(k)
        if len(groups) != k:  # fewer blocks to replay than planned: a shorter window, later
            return None
        if self.host is None and self._staging is not None:
            staging, self._staging = self._staging, None
            self.host, self.grad_pool = staging.take()
        if self.host is None:  # planned again: allocated now
            self.host = HostCopy(self.plan, self.device)
            if self.policy.replays:
                self.grad_pool = GradPool(self.plan, self.device)
        final = step + k - 1
        job = Job(step, k, self.loop.boundary, groups, self.config.mode,
                  os.path.join(self.config.directory, name) if name is not None else
                  _checkpoint_path(self.config.directory, final), host=self.host,
                  plan=self.plan, tables=tables)
        job.on_fail = self._on_job_failed
        job.named = name is not None
        if not self.ranks.several and self.policy.streams:
            job.on_final = self.persister.blocks_final
        job.metrics.add_blocked("save_checkpoint_busy_wait", waited)
        self.capture.declare_state_keys(self.host)
        job.metrics.state_bytes = self.capture.state_bytes(self.host)
        self._job = job
        log.info("gockpt: checkpoint of step %d: %s", final,
                 f"copied over the {k} steps up to it (K={k}, "
                 f"{'as configured' if self.config.overlap_steps else 'measured'})" if k > 1
                 else "copied under the next step")
        self.pipeline.begin(job, step, self.loop.boundary, extra_state)
        return job.handle

    def _min_blocks(self) -> int:
        """Blocks the plan needs: an explicit K of a replay mode needs K groups."""
        return self.config.overlap_steps or 1 if self.policy.replays else 1

    def _allocate_staging(self) -> StagingAllocation:
        """Start allocating the host staging in the background (see StagingAllocation)."""
        if self.adapter is not None:
            keys = self.adapter.state_keys
        elif isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            keys = ("exp_avg", "exp_avg_sq")  # what its state will hold after the first step
        else:
            keys = None
        grads = () if not self.policy.replays else \
            (torch.bfloat16,) if self.config.grad_transport == "bf16" else (torch.float32,)
        return StagingAllocation(self.plan, self.device, keys, grads)

    def _replan(self) -> None:
        """The optimizer's parameters changed: plan again (a replay mode checks the new param
        groups' settings as at construction); host memory is allocated anew."""
        adapted = {s.name for s in self.plan.slots if s.at_f and not s.static}
        plan = build_plan(self.model, self.optimizer, self.config.block_bytes,
                          self._min_blocks())
        plan.copy_at_f(adapted)
        if self.policy.replays:
            self.adapter.close()
            self.adapter = self.capture.adapter = self.replayer.adapter = \
                adapter_for(self.optimizer)
        if device_for([s.param for s in plan.slots]).kind != self.device.kind:
            raise ConfigError("the optimizer's new parameters live on another device")
        self.plan = plan
        self.planned_host_bytes = planned_host_bytes(self.plan, self.policy.replays, self.config.max_host_bytes)
        if self._staging is not None:  # allocated for the old plan: let it go
            self._staging.take()
        self.host, self.grad_pool, self._staging = None, None, None
        log.info("gockpt: the optimizer's parameters changed: planned again (%d tensors)",
                 len(plan.slots))

    def _wait_for_previous(self, step: int, quiet: bool = False) -> Optional[float]:
        """Seconds waited for the previous checkpoint to persist; None: skip this one (with a
        warning unless ``quiet``: a window not asked for yet, decided again at its step)."""
        prev = self._job
        # On several ranks decided from the step count alone, so that every rank decides
        # alike; on one, a window that failed before its step lets that step be taken anew.
        if prev is not None and self.loop.boundary <= prev.f_boundary and not prev.dropped \
                and (prev.capturing or self.ranks.several):
            if not quiet:
                warnings.warn(f"gockpt: checkpoint at step {step} skipped: the checkpoint of "
                              f"step {prev.handle.final_step} is still being captured",
                              stacklevel=4)
            return None
        if prev is None or prev.handle.done():
            return 0.0
        if self.config.on_busy == "skip":
            if not quiet:
                warnings.warn(f"gockpt: checkpoint at step {step} skipped: the checkpoint of "
                              f"step {prev.handle.final_step} is still persisting "
                              "(on_busy='skip')", stacklevel=4)
            return None
        t0 = time.perf_counter()
        prev.progress.durable.wait()
        waited = time.perf_counter() - t0
        self.loop.raise_pending()
        return waited

    # ------------------------------------------------------------------ gradients

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Step pre-hook: the gradients are exactly what this update consumes."""
        with self._charged("optimizer_step"):
            self._record_gradients()

    def _record_gradients(self) -> None:
        job = self._job
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
            job.capture.replan = True
            job.fail(ConsistencyError(
                "the optimizer's parameters changed during the checkpoint (add_param_group, or a "
                "param group's list edited)"))
            return
        if self.adapter is None:
            return
        j = job.window_step(self.loop.boundary)
        if j < job.k:  # the update of window step K produces F + 1: not needed
            ticket = self.pipeline.record_gradients(job, j, groups, self.grad_pool)
            if ticket is not None:
                self._grad_tickets.append(ticket)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Step post-hook (gockpt-o): the update overlapped the gradient copies; nothing that
        runs after it (an in-place zero_grad, another backward accumulating into .grad) may
        change a gradient before its copy has landed. On a GPU the compute stream waits for
        the copies (the CPU goes on); on the CPU this thread waits."""
        if self._grad_tickets:
            with self._charged("optimizer_step"):
                self._wait_grad_copies()

    def _wait_grad_copies(self) -> None:
        tickets, self._grad_tickets = self._grad_tickets, []
        for t in tickets:
            try:
                self.device.order_after(t)
            except BaseException as exc:
                if self._job is not None:
                    self._job.fail(exc)

    @contextlib.contextmanager
    def _charged(self, hook: str):
        """Time spent in this hook counts as blocked time of the checkpoint in its window (or
        of the one the hook starts); parts that inner code charged under their own name
        (e.g. the busy wait) are not counted twice."""
        job = self._job if self._job is not None and self._job.capturing else None
        before = job.metrics.blocked_s if job is not None else 0.0
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            if self._job is not job:
                job, before = self._job, 0.0  # started by this hook
            if job is not None:
                inner = job.metrics.blocked_s - before
                job.metrics.add_blocked(hook, max(0.0, elapsed - inner))
                if not job.capturing:
                    job.accounts_closed.set()  # its window is over: the metrics are final

    def _on_job_failed(self, job: Job) -> None:
        """Any thread: ``job`` failed (see Loop.job_failed); on several ranks it still votes."""
        # failed in its window, before its step (one rank): that step is taken anew
        retaken = not self.ranks.several and job.small is None \
            and self.loop.boundary < job.f_boundary
        if retaken and isinstance(job.error, UnsupportedOptimizerError):
            self._windows_off = True  # the next windows would fail alike
        self.loop.job_failed(job, retaken=retaken)
        if self.ranks.several and not job.stream.entered and not job.dropped:
            self.persister.queue_persist(job)  # it still votes, so that the other ranks do not wait


def _checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, storage.checkpoint_name(step))


# Checkpointers not closed when the interpreter exits (an exception escaped the loop, no
# ``with``): closed by an atexit hook, before the interpreter stops its daemon threads --
# stopped there, a thread inside the C++ writer would end the process with std::terminate.
_open: "weakref.WeakSet" = weakref.WeakSet()
_exit_hook = []


def _close_at_exit(ck: Checkpointer) -> None:
    _open.add(ck)
    if not _exit_hook:
        _exit_hook.append(atexit.register(_close_open))


def _close_open() -> None:
    for ck in list(_open):
        try:
            ck.close()
        except Exception as exc:  # noqa: BLE001 -- the process is ending: say it, go on
            log.error("gockpt: closing the checkpointer of %s at exit: %s",
                      ck.config.directory, exc)
