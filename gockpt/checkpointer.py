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

This module decides *when* (the hooks, starting, errors) and :mod:`gockpt.lifecycle` how it
ends; :mod:`gockpt.core.modes` says what each mode does, :mod:`gockpt.schedule` when a
checkpoint is due and its K, and each pipeline stage lives in its own package: ``capture/`` ->
``replay/`` -> ``storage/``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Union

import torch

from .capture.copies import Capture
from .core import runlog
from .core.digest import LiveDigests
from .capture.devices import device_for
from .core.names import is_replicated
from .core.planning import build_plan, same_params
from .core.staging import HostStaging, gradient_dtypes, planned_host_bytes
from .capture.transfer import CopyEngine
from .capture.transport import Bf16Transport
from .core.config import Config, GradTransport, Interval, OnBusy, check_step
from .core.errors import ConfigError, UnsupportedOptimizerError
from .core.job import CheckpointHandle, Job
from .core.latch import Latch
from .exit import close_at_exit
from .hooks import BlockedTime, StepHooks
from .lifecycle import Lifecycle
from .loop import BACKWARD, IDLE, UPDATE, Loop
from .replay.adapters import attach_adapter, state_keys_of
from .replay.replayer import Replayer
from .pipeline import Pipeline
from .schedule import MAX_K, Busy, Schedule
from .storage.commit import cleanup_temporaries, ensure_writable
from .storage.lock import lock_for_ranks
from .storage.persist import Persister
from .steplog import StepLog, log_spacing
from .tiers import Tiers
from .storage.ranks import Ranks

log = logging.getLogger("gockpt")


class Checkpointer(Lifecycle):
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
        try:
            self._construct(model, optimizer, scheduler)
        except BaseException:
            self.ranks.close()
            raise
        close_at_exit(self)

    def _construct(self, model, optimizer, scheduler) -> None:
        """Everything after the ranks' groups are made (destroyed again if this raises)."""
        if self.ranks.several and (self.config.interval is Interval.AUTO
                                   or self.config.on_busy is OnBusy.SKIP):
            raise ConfigError("with several ranks every rank must start the same checkpoints: "
                              "use a fixed interval (or force) and on_busy='wait'")
        if self.config.replicated is None and is_replicated(model):
            self.config.replicated = True  # (None: DTensors replicated as their placements say)
        self.plan = self._new_plan()
        if self.config.memory_log is not None and self.ranks.several and not (
                self.plan.dtensors or self.config.replicated is True):
            raise ConfigError("memory_log: the step log keeps one process's, DDP's or "
                              "FSDP2's steps; with ranks of other models leave it off "
                              "(memory= alone works)")
        ensure_writable(self.config.directory)
        self.lock = lock_for_ranks(self.config.directory, self.ranks)
        self.adapter = None
        try:
            self.adapter = attach_adapter(self.plan, optimizer) if self.policy.replays else None
            self._build(model, optimizer, scheduler)
        except BaseException:
            self.lock.release()
            if self.adapter is not None:
                self.adapter.close()
            raise

    def _build(self, model, optimizer, scheduler) -> None:
        """Everything that needs the directory lock."""
        cleanup_temporaries(self.config.directory)
        self.device = device_for(self.plan.locals())
        self.planned_host_bytes = planned_host_bytes(self.plan, self.policy, self.device,
                                                     self.config.max_host_bytes)
        if self.config.emulate_link_gbps is not None and self.device.kind != "cpu":
            raise ConfigError("emulate_link_gbps emulates a GPU link for training on the CPU; "
                              f"the parameters live on {self.device.kind}")
        self.engine = CopyEngine(self.device, link_gbps=self.config.emulate_link_gbps)
        self.staging = HostStaging(self.plan, self.device, state_keys_of(optimizer) or None,
                                   gradient_dtypes(self.policy.replays, self.config.grad_transport))
        self.replayer = Replayer(self.adapter, self.config.replay_threads) if self.adapter else None
        transport = Bf16Transport(self.config.grad_multiplier) \
            if self.config.grad_transport is GradTransport.BF16 and self.adapter is not None else None
        self.capture = Capture(model, optimizer, scheduler, self.engine, self.adapter, transport)
        self.schedule = Schedule(self.config, self.ranks.several)
        logged = self.config.memory_log is not None  # (its size refused before a tier starts)
        spacing = log_spacing(model, self.config.memory_log) if logged else None
        self.tiers = Tiers(self.config, self.ranks, self.plan.state_bytes(2), self._copies_in_progress)
        self.steplog = None  # the memory tier's step log (Config.memory_log)
        if logged and self.tiers.memory is not None:
            self.schedule.log_spacing = spacing
            self.steplog = StepLog(model, optimizer, scheduler, self.tiers.memory.root,
                                   self.config.memory_log, self.device, self.plan.slot_of_id,
                                   self.ranks.rank if self.ranks.several else None)
        self.persister = Persister(self.config, self.plan, self.ranks, type(optimizer).__name__,
                                   step_time=self.schedule.median_step_time,
                                   host_bytes=self.staging.nbytes,
                                   on_durable=self._on_durable,
                                   publish=self.tiers.publish if self.tiers.tiers else None)
        self.digester = LiveDigests(self.device) if self.config.verify else None
        self.pipeline = Pipeline(self.config, self.capture, self.replayer, self.persister,
                                 digester=self.digester)
        self.loop = Loop()
        self._loop_thread = threading.current_thread()  # the training thread: it builds us
        self._completing = threading.Lock()
        self._job: Optional[Job] = None
        self._last_asked: Optional[Job] = None  # the last checkpoint whose step was reached
        self._windows_off = False  # the replay could not follow: copied at the step from now
        self._blocked = BlockedTime(lambda: self._job)
        self._step_hooks = StepHooks(optimizer, self.loop, lambda: self._job, self.pipeline,
                                     self.staging, self.device, self.policy.replays,
                                     self._blocked, self.steplog)
        self._progress = runlog.Progress(self.config.directory, self.ranks.rank == 0)
        if self.ranks.rank == 0:  # a process of the job started: goodput's attempts
            runlog.record(self.config.directory, "start", world_size=self.ranks.world_size,
                          mode=self.config.mode)
        log.info("gockpt: %s mode, %d tensors in %d blocks, %.1f MiB host staging planned",
                 self.config.mode, len(self.plan.slots), len(self.plan.blocks),
                 self.planned_host_bytes / 2**20)

    # ------------------------------------------------------------------ hooks

    def backward_begin(self) -> None:
        """Call right before ``loss.backward()``: gradients are about to change.

        May be called again for the same step when the previous attempt was abandoned
        (``loss.backward()`` raised, or a gockpt error was raised and caught)."""
        self.loop.enter("backward_begin", IDLE, BACKWARD)
        self.loop.raise_pending()  # after the transition: a caught error leaves the loop usable

    def update_begin(self) -> None:
        """Call after backward (and clipping/unscaling), right before ``optimizer.step()``:
        this step's state copies must be done before the optimizer changes the state."""
        self.loop.check_open()
        self.loop.expect("update_begin", BACKWARD)
        self.schedule.reached_update()
        with self._blocked("update_begin"):
            self.pipeline.before_update()
            job = self._job
            if job is not None and job.capturing and job.error is None:
                self.pipeline.land(job, job.window_step(self.loop.boundary))
        if self.steplog is not None:
            self.steplog.before_update()
        self.loop.phase = UPDATE
        self.loop.raise_pending()

    def save_checkpoint(self, step: int, extra_state: Union[dict, Callable[[], dict], None] = None,
                        *, force: bool = False, name: Optional[str] = None
                        ) -> Optional[CheckpointHandle]:
        """The step boundary: call once at the end of every step, after ``optimizer.step()``
        and ``scheduler.step()``.

        Checkpoints the state of this very step when ``force`` is true, ``interval`` divides
        ``step`` or :meth:`plan_checkpoint` announced it, and returns its handle (else None):
        named for ``step``, the state right after its update, bit for bit, with ``extra_state``
        (a dict, or a zero-argument callable called here) as given now -- tensors, numbers,
        strings, lists and dicts, stored without pickle. ``name``: a tag instead (DeepSpeed's
        ``global_step<N>``) no entry has, or a killed job's beyond ``latest`` (replaced).

        When the step of the next checkpoint is known in advance (``interval``,
        :meth:`plan_checkpoint`, or the spacing of the previous forced saves), the replay
        modes start copying K - 1 steps before it so that the copy rides under training; a
        checkpoint asked for without notice is copied under the next step's forward/backward
        (as ``async-o``).
        """
        self.loop.check_open()
        if name is not None:
            self.ranks.check_name(self.config.directory, name)
        check_step(step)
        if self.steplog is not None and callable(extra_state):
            extra_state = extra_state()  # (taken once: the checkpoint and the log hold it)
        loop = self.loop
        self.schedule.reached_boundary(loop.reach_boundary(step))
        self._progress.boundary(step)
        handle = None
        with self._blocked("save_checkpoint"):
            asked = force or self.schedule.due(step)
            job = self._job
            if job is not None and job.capturing and job.error is None:
                if job.is_final_boundary(loop.boundary) and asked:
                    self.pipeline.boundary(job, step, loop.boundary, extra_state, name)
                    handle = self._asked(job, step)
                elif job.is_final_boundary(loop.boundary) or asked:
                    # its step is not the one asked for: nothing of it is visible
                    log.info("gockpt: the checkpoint planned for step %d is dropped (%s at "
                             "step %d)", job.handle.final_step,
                             "a save asked" if asked else "no save", step)
                    job.drop()
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
        if self.steplog is not None:
            self.steplog.boundary(step, extra_state)
        return handle

    def plan_checkpoint(self, step: int) -> None:
        """Announce a checkpoint at ``step``: a save schedule that is not a fixed interval, or
        the last step of training. ``save_checkpoint(step)`` then takes it without ``force``,
        and the replay modes copy its state over the K steps up to it instead of under the
        step after it (as for a checkpoint asked for without notice)."""
        self.loop.check_open()
        check_step(step)
        self.schedule.announce(step)

    def _asked(self, job: Job, step: int) -> CheckpointHandle:
        """``job`` reached the step it was asked for: what ``wait()`` now waits for."""
        self.schedule.asked(step)
        if self.ranks.several and self.config.fixed_overlap_steps() is None:
            self.schedule.agreed_k = self.ranks.agree_max(  # for the next window
                self.schedule.measured_k(self.plan, self.engine.bandwidth(), self.policy.replays))
        self._last_asked = job
        self._watch(job)
        return job.handle

    def _maybe_start_window(self, step: int) -> None:
        """Start the window of the next expected checkpoint when it must start here: K - 1 steps
        before its step (fewer, where K grew past that boundary: Schedule.window_starting)."""
        if not self.policy.replays or self._windows_off or (self._job and self._job.capturing) \
                or not self.schedule.window_may_start(step):  # (usual: no K worked out)
            return
        k = self.schedule.window_k(self.plan, self.engine.bandwidth(), self.policy.replays)
        span = self.schedule.window_starting(step, k)
        if span is not None:
            self._start(step, span, None, None)

    def _on_durable(self, job: Job) -> None:
        """A checkpoint was committed (persist thread; the tiers have it already): the
        schedule learns its stall, the step log drops what it no longer needs."""
        self.schedule.durable(job.metrics.blocked_s)
        if self.steplog is not None:
            self.steplog.committed(job.handle.final_step)

    def _copies_in_progress(self) -> Optional[Latch]:
        """Any thread: the latch that ends the current checkpoint's copies under training (its
        hooks' blocked time), or None; the remote tier's uploads pause until then."""
        job = self._job
        return None if job is None or job.accounts_closed.is_set() else job.accounts_closed

    @property
    def host_bytes(self) -> int:
        """Host memory gockpt holds for staging (state copy + gradient buffers; training on
        the CPU, gockpt-o's gradient snapshots too)."""
        return self.staging.nbytes() + self.capture.grads.snapshot_bytes()

    @property
    def host(self):
        """The host copy of the state (None before the first checkpoint)."""
        return self.staging.host

    # ------------------------------------------------------------------ the window

    def _start(self, step: int, k: int, extra_state, name: Optional[str]
               ) -> Optional[CheckpointHandle]:
        """Start a checkpoint of K steps at this boundary: K = 1 copies the state of ``step``
        (asked for now); K > 1 is the window of the checkpoint expected at ``step + K - 1``.
        None when it does not start (the previous one is still busy and ``on_busy="skip"``;
        a window whose K no longer fits the plan starts at a later boundary)."""
        prev, waited = self._job, 0.0
        busy = self.schedule.previous_busy(prev, step, self.loop.boundary, quiet=k > 1)
        if busy is Busy.SKIP:
            return None
        if busy is Busy.WAIT:
            t0 = time.perf_counter()
            prev.progress.durable.wait()
            waited = time.perf_counter() - t0
            self.loop.raise_pending()
        if self._job is not None and self._job.error is not None:
            self.pipeline.settle(self._job)  # its staging is about to be reused
        if not same_params(self.optimizer, self.plan.fingerprint):
            self._replan()
        self.capture.check_layouts(self.plan)
        self.plan.copy_at_f(self.loop.take_adapted())
        if len(self.plan.groups(k)) != k:  # fewer blocks to replay: a shorter window, later
            return None
        self.staging.ready(self.plan)
        self._job = job = self.pipeline.new_job(
            step, k, self.loop.boundary, self.plan, self.staging.host, name, waited,
            self._on_job_failed, not self.ranks.several and self.policy.streams)
        self.pipeline.begin(job, step, self.loop.boundary, extra_state)
        return job.handle

    def _new_plan(self):
        """The plan of the model and optimizer as they are, cut among the ranks (training
        thread, on every rank)."""
        # a K measured later (up to MAX_K) must find as many blocks to spread (one flat
        # partition of DeepSpeed's is otherwise a few blocks of block_bytes)
        measured = self.policy.replays and self.config.fixed_overlap_steps() is None
        plan = self.ranks.share(build_plan(self.model, self.optimizer, self.config.block_bytes,
                                           self._min_blocks(), self.ranks.world_size,
                                           want_blocks=MAX_K if measured else 1),
                                self.config.replicated, self.config.global_slices)
        plan.mark_step_written(self.config.step_written)
        return plan

    def _min_blocks(self) -> int:
        """Blocks the plan needs: an explicit K of a replay mode needs K groups."""
        return self.config.overlap_steps or 1 if self.policy.replays else 1

    def _replan(self) -> None:
        """The optimizer's parameters changed: plan again (a replay mode checks the new param
        groups' settings as at construction); host memory is allocated anew."""
        step_written = self.config.step_written or ()
        adapted = {s.name for s in self.plan.slots if s.at_f and not s.static
                   or s.name in step_written and not s.step_written}
        plan = self._new_plan()
        plan.copy_at_f(adapted)
        if self.policy.replays:
            self.adapter.close()
            self.adapter = self.capture.adapter = self.replayer.adapter = \
                attach_adapter(plan, self.optimizer)
        if device_for(plan.locals()).kind != self.device.kind:
            raise ConfigError("the optimizer's new parameters live on another device")
        self.plan = plan
        self.planned_host_bytes = planned_host_bytes(self.plan, self.policy, self.device,
                                                     self.config.max_host_bytes)
        self.staging.replanned()
        log.info("gockpt: the optimizer's parameters changed: planned again (%d tensors)",
                 len(plan.slots))

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
