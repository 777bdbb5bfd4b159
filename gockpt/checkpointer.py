"""The training-loop hooks and the life of one checkpoint.

A checkpoint started at step boundary N spans K steps and holds version F = N + K - 1:

    boundary N     queue copies of group 1 (the copy thread runs them under step N+1's fwd/bwd)
    step N+j       update_begin waits for group j (version N+j-1); the optimizer's step pre-hook
                   records the gradients of step N+j for the blocks captured so far (j < K)
    boundary F     capture everything small (buffers, scheduler, RNG, step, extra state)
    step N+K       update_begin waits for the last group (version F): all blocks captured
    background     replay brings every block to F -> self-check -> write -> commit

``sync``/``async`` copy everything at boundary N (K = 1, blocking); ``async-o`` is K = 1 with the
copies under one step; ``gockpt`` waits for gradient copies in the step, ``gockpt-o`` at the next
``backward_begin``.

This module decides *when* (the hooks, starting, K, the interval, errors); each stage lives in
its own module, in pipeline order:

    plan.py       which blocks, in which groups
    capture.py    what the hooks queue: state groups, small state at F, gradient records
    transfer.py   the copy engine (device -> host)
    replay.py     brings every block captured before F up to F
    selfcheck.py  replayed blocks must equal a direct copy at F
    persist.py    the persist thread: stream blocks at F, commit, retention
    storage.py    the on-disk format and the atomic commit
    job.py        one checkpoint's handle and book-keeping, shared by all of them
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
import warnings
from typing import Callable, List, Optional, Union

import torch

from . import storage
from .capture.copies import Capture
from .capture.device import device_for
from .capture.plan import Block, build_plan
from .capture.staging import GradPool, HostCopy
from .capture.transfer import CopyEngine
from .config import Config
from .errors import CheckpointFailedError, ConfigError, GockptError, HookOrderError
from .job import CheckpointHandle, Job
from .replay import selfcheck
from .replay.adapters import adapter_for
from .replay.replayer import Replayer
from .storage.commit import cleanup_temporaries, ensure_writable
from .storage.persist import Persister
from .storage.ranks import Ranks

log = logging.getLogger("gockpt")

# Loop phases: which hook may come next.
_IDLE, _BACKWARD, _UPDATE = "idle (after save_checkpoint)", "backward", "update"


class Checkpointer:
    """Checkpoints a model and its optimizer without stopping training for the state copy.

    Call the three hooks every step (see DESIGN.md section 3)::

        ck.backward_begin(); loss.backward(); ck.update_begin()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        handle = ck.save_checkpoint(step + 1)

    Args:
        model: the ``torch.nn.Module`` being trained.
        optimizer: its optimizer. The gockpt modes need ``torch.optim.Adam``/``AdamW`` (refused
            otherwise with :class:`~gockpt.errors.UnsupportedOptimizerError`).
        directory: where checkpoints go (created if missing).
        mode: ``"sync" | "async" | "async-o" | "gockpt" | "gockpt-o"``.
        overlap_steps: K for the gockpt modes; ``None`` measures and chooses.
        scheduler: optional LR scheduler, saved at version F.
        interval: start a checkpoint every ``interval`` steps (``None``: only when forced;
            ``"auto"`` with ``mtbf=SECONDS``: the Young/Daly optimum, re-measured).
        **options: further :class:`~gockpt.config.Config` fields (``mtbf``, ``block_bytes``,
            ``self_check``, ``self_check_strict``, ``on_busy``, ``replay_threads``).
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
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.ranks = Ranks()  # collective on several ranks: every rank builds its Checkpointer
        if self.ranks.several and (self.config.interval == "auto"
                                   or self.config.on_busy == "skip"):
            raise ConfigError("with several ranks every rank must start the same checkpoints: "
                              "use a fixed interval (or force) and on_busy='wait'")
        self.plan = build_plan(model, optimizer, self.config.block_bytes)
        self.adapter = adapter_for(optimizer) if self.config.replays else None
        ensure_writable(self.config.directory)
        cleanup_temporaries(self.config.directory)

        self.planned_host_bytes = self._plan_host_bytes()
        cap = self.config.max_host_bytes
        if cap is not None and self.planned_host_bytes > cap:
            raise ConfigError(
                f"gockpt needs {self.planned_host_bytes / 2**20:.1f} MiB of host memory for "
                f"staging (state copy + gradient buffers) but max_host_bytes is "
                f"{cap / 2**20:.1f} MiB; raise the cap or use a mode without replay (no "
                "gradient buffers)")
        log.info("gockpt: %s mode, %d tensors in %d blocks, %.1f MiB host staging planned",
                 self.config.mode, len(self.plan.slots), len(self.plan.blocks),
                 self.planned_host_bytes / 2**20)
        self.device = device_for([s.param for s in self.plan.slots])
        self.engine = CopyEngine(self.device)
        self.host: Optional[HostCopy] = None          # allocated at the first checkpoint
        self.grad_pool: Optional[GradPool] = None
        self.replayer = Replayer(self.adapter, self.config.replay_threads) if self.adapter else None
        self.capture = Capture(self.plan, model, optimizer, scheduler, self.engine, self.adapter)
        self.persister = Persister(self.config, self.plan, self.ranks, type(optimizer).__name__,
                                   step_time=self._median_step_time,
                                   host_bytes=lambda: self.host_bytes,
                                   on_durable=self._on_durable)

        self._phase = _IDLE
        self._boundary = 0
        self._steps_seen = 0
        self._job: Optional[Job] = None
        self._grad_tickets: List = []
        self._errors: List[Job] = []
        self._errors_lock = threading.Lock()
        self._hook_error: Optional[str] = None
        self._t_boundary = time.perf_counter()
        self._fwd_bwd_times: List[float] = []
        self._step_times: List[float] = []
        self._closed = False
        self._after_error = False
        self._last_start_step: Optional[int] = None
        self._auto_interval: Optional[int] = None
        self._auto_counted = 0
        self._durable_count = 0
        self._finished: List[Job] = []   # durable jobs, for interval="auto"

        self._pre_hook = optimizer.register_step_pre_hook(self._on_optimizer_step)
        self._orig_zero_grad = optimizer.zero_grad
        if self.config.mode == "gockpt-o":
            # Gradient copies may still be reading .grad after the step; an in-place zeroing
            # (set_to_none=False) must wait for them.
            optimizer.zero_grad = self._zero_grad

    # ------------------------------------------------------------------ hooks

    def backward_begin(self) -> None:
        """Call right before ``loss.backward()``: gradients are about to change."""
        self._check_open()
        self._expect("backward_begin", _IDLE)
        self._wait_grad_copies("backward_begin")
        self._phase = _BACKWARD
        self._raise_pending()  # after the transition: a caught error leaves the loop usable

    def update_begin(self) -> None:
        """Call after backward (and clipping/unscaling), right before ``optimizer.step()``:
        this step's state copies must be done before the optimizer changes the state."""
        self._check_open()
        self._expect("update_begin", _BACKWARD)
        now = time.perf_counter()
        self._fwd_bwd_times = (self._fwd_bwd_times + [now - self._t_boundary])[-16:]
        job = self._job
        if job is not None and job.capturing and job.error is None:
            j = self._boundary - job.start_boundary + 1
            ticket = job.tickets.get(j)
            if ticket is not None:
                t0 = time.perf_counter()
                try:
                    ticket.wait()
                except BaseException as exc:
                    job.fail(exc)
                job.metrics.add_blocked("update_begin", time.perf_counter() - t0)
                job.captured.extend(job.groups[j - 1])
            if j >= job.k and job.error is None:
                job.capturing = False
                self._finish_capture(job)
        self._phase = _UPDATE
        self._raise_pending()

    def save_checkpoint(self, step: int, extra_state: Union[dict, Callable[[], dict], None] = None,
                        *, force: bool = False) -> Optional[CheckpointHandle]:
        """The step boundary: call once at the end of every step, after ``optimizer.step()``
        and ``scheduler.step()``.

        Starts a checkpoint when ``force`` is true or ``interval`` divides ``step`` and returns
        its handle (otherwise ``None``). ``extra_state`` (a dict, or a zero-argument callable
        called only at the boundary of F) holds tensors, numbers, strings, lists and dicts;
        it is stored without pickle.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"step must be an int, got {step!r}")
        if self._phase != _UPDATE and not (self._phase == _IDLE and self._steps_seen == 0):
            raise HookOrderError(
                f"save_checkpoint({step}) called in phase '{self._phase}'; call it once per "
                "step, after update_begin() and optimizer.step()")
        now = time.perf_counter()
        if self._phase == _UPDATE:
            self._steps_seen += 1
            self._step_times = (self._step_times + [now - self._t_boundary])[-16:]
        self._boundary += 1
        self._phase = _IDLE

        job = self._job
        if job is not None and job.capturing and job.error is None:
            t0 = time.perf_counter()
            try:
                if self._boundary == job.f_boundary:
                    self._capture_small(job, step, extra_state)
                j_next = self._boundary - job.start_boundary + 1
                if j_next <= job.k:
                    self.capture.enqueue_group(job, j_next)
            except GockptError as exc:
                job.fail_reported(exc)
                raise
            except Exception as exc:
                job.fail_reported(exc)
                raise CheckpointFailedError(
                    f"checkpoint of step {job.handle.final_step} failed at the step boundary: "
                    f"{exc}", job.handle.final_step) from exc
            finally:
                job.metrics.add_blocked("save_checkpoint", time.perf_counter() - t0)

        self._raise_pending()  # the boundary is recorded; no new checkpoint after a failure
        handle = None
        if force or self._due(step):
            handle = self._start(step, extra_state)
            if handle is not None:
                self._last_start_step = step
        self._t_boundary = time.perf_counter()
        return handle

    # ------------------------------------------------------------------ lifecycle

    def wait(self) -> None:
        """Block until the latest started checkpoint is durable; re-raise background errors."""
        last = self._job
        if last is not None and not last.capturing:
            last.handle._durable.wait()
        self._raise_pending()

    def close(self) -> None:
        """Finish or drop in-flight work, stop every thread, and re-raise background errors.

        A checkpoint whose version F has been reached is completed (waiting until durable);
        one that still needed training steps is dropped with a warning, nothing of it visible.
        """
        if self._closed:
            return
        self._closed = True
        job = self._job
        try:
            if job is not None and job.capturing and job.error is None:
                if self._boundary >= job.f_boundary and job.small is not None \
                        and self._phase == _IDLE:
                    self.capture.copy_rest(job)
                    self._finish_capture(job)
                else:
                    warnings.warn(
                        f"gockpt: checkpoint of step {job.handle.final_step} was still being "
                        "captured at close() (training stopped before its final step); it is "
                        "dropped and the previous checkpoint stays latest", stacklevel=2)
                    job.drop()
            self._wait_grad_copies(None)
            if self.replayer is not None:
                self.replayer.close()
            self.persister.close()
        finally:
            self.engine.close()
            self._pre_hook.remove()
            if self.optimizer.zero_grad == self._zero_grad:
                self.optimizer.zero_grad = self._orig_zero_grad
        self._raise_pending()

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

    # ------------------------------------------------------------------ starting

    def _start(self, step: int, extra_state) -> Optional[CheckpointHandle]:
        prev = self._job
        # Decided from the step count alone, so that every rank decides alike.
        if prev is not None and self._boundary <= prev.f_boundary and not prev.dropped:
            warnings.warn(f"gockpt: checkpoint at step {step} skipped: the checkpoint of step "
                          f"{prev.handle.final_step} is still being captured", stacklevel=3)
            return None
        waited = 0.0
        if prev is not None and not prev.handle.done():
            if self.config.on_busy == "skip":
                warnings.warn(f"gockpt: checkpoint at step {step} skipped: the checkpoint of "
                              f"step {prev.handle.final_step} is still persisting "
                              "(on_busy='skip')", stacklevel=3)
                return None
            t0 = time.perf_counter()
            prev.handle._durable.wait()
            waited = time.perf_counter() - t0
            self._raise_pending()

        if self.host is None:
            self.host = HostCopy(self.plan, self.device)
            if self.config.replays:
                self.grad_pool = GradPool(self.plan, self.device)
        k = self.ranks.agree_max(self._choose_k())
        groups = self.plan.groups(k)
        k = len(groups)
        job = Job(step, k, self._boundary, groups, self.config.mode,
                   0, _checkpoint_path(self.config.directory, step + k - 1))
        job.host = self.host
        job.on_fail = self._on_job_failed
        if not self.ranks.several and self.config.mode != "sync":
            job.on_final = self.persister.block_final
        job.metrics.add_blocked("save_checkpoint_busy_wait", waited)
        self.capture.declare_state_keys(self.host)
        job.metrics.state_bytes = self.capture.state_bytes(self.host)
        self._job = job

        t0 = time.perf_counter()
        try:
            if k == 1:
                self._capture_small(job, step, extra_state)
            self.capture.enqueue_group(job, 1)
            if self.config.mode in ("sync", "async"):
                self.capture.copy_rest(job)
        except GockptError as exc:
            job.fail_reported(exc)
            raise
        except Exception as exc:
            job.fail_reported(exc)
            raise CheckpointFailedError(f"checkpoint at step {step} could not start: {exc}",
                                        step) from exc
        finally:
            # Accounted before the job can reach the writer, which records the metrics.
            job.metrics.add_blocked("save_checkpoint", time.perf_counter() - t0)
        if self.config.mode in ("sync", "async"):
            self._finish_capture(job)  # sync: persists inline, the time counted by the persister
        if self.config.mode == "sync":
            self._raise_pending()
        return job.handle

    def _due(self, step: int) -> bool:
        interval = self.config.interval
        if interval is None:
            return False
        if interval != "auto":
            return step % interval == 0
        self._update_auto_interval()
        if self._last_start_step is None:
            return step >= self.config.first_auto_step
        if self._auto_interval is None:
            return False  # the first checkpoint's stall is not measured yet
        return step - self._last_start_step >= self._auto_interval

    def _update_auto_interval(self) -> None:
        """Recompute N* from the stalls and step time measured so far (after each checkpoint)."""
        from .interval import auto_interval

        done = list(self._finished)
        if self._durable_count == self._auto_counted or not done or not self._step_times:
            return
        self._auto_counted = self._durable_count
        stall = statistics.median(j.metrics.blocked_s for j in done[-8:])
        step_time = statistics.median(self._step_times)
        if stall <= 0 or step_time <= 0:
            return
        self._auto_step_time = step_time
        new = auto_interval(stall, step_time, self.config.mtbf)
        if new != self._auto_interval:
            log.info("gockpt: checkpoint interval %s -> %d steps (stall %.4fs, step %.4fs, "
                     "MTBF %.0fs)", self._auto_interval, new, stall, step_time, self.config.mtbf)
            self._auto_interval = new

    def _plan_host_bytes(self) -> int:
        """Host memory of one state copy plus, with replay, the pool of gradient buffers."""
        planned = self.plan.state_bytes(2)  # Adam-like optimizers: two aligned state tensors
        if self.config.replays:
            planned += GradPool.SIZE * self.plan.optimized_bytes()
        return planned

    def _choose_k(self) -> int:
        fixed = self.config.fixed_overlap_steps()
        if fixed is not None:
            return fixed
        if not self._fwd_bwd_times:
            return 2  # nothing measured yet
        fwd_bwd = statistics.median(self._fwd_bwd_times)
        bandwidth = self.engine.bandwidth() or _probe_bandwidth()
        copy_s = self.plan.state_bytes(2) / bandwidth  # Adam: parameter + two moments
        # Enough steps for the state copies to ride under forward/backward; the paper's
        # analysis finds the best K near 7 on GPUs, beyond which gradient traffic grows
        # faster than the saving.
        return max(1, min(8, math.ceil(copy_s / max(fwd_bwd, 1e-6))))

    def _finish_capture(self, job: Job) -> None:
        """All blocks captured: replay (if any) then self-check and persist."""
        if job.on_final is not None:
            self.persister.queue_captured(job)  # the last group is at F: write it
        if self.replayer is not None:
            self.replayer.barrier(lambda: self._after_replay(job))
        else:
            self._after_replay(job)

    def _capture_small(self, job: Job, step: int, extra_state) -> None:
        """Freeze everything small at the boundary of F (and sample blocks for the self-check)."""
        if step != job.handle.final_step:
            warnings.warn(f"gockpt: expected step {job.handle.final_step} at the final boundary "
                          f"of this checkpoint, got {step}; save_checkpoint should be called "
                          "every step with consecutive step numbers", stacklevel=4)
            job.handle.final_step = job.metrics.final_step = step
            job.handle.path = _checkpoint_path(self.config.directory, step)
        self.capture.freeze_small(job, step, extra_state)
        if self.adapter is not None:
            selfcheck.sample(job, self.plan, self.optimizer, self.config.self_check)
        if job.on_final is not None:
            self.persister.queue_open(job)

    # ------------------------------------------------------------------ gradients

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Step pre-hook: the gradients are exactly what this update consumes."""
        if self._phase != _UPDATE:
            self._hook_error = (f"optimizer.step() ran in phase '{self._phase}': call "
                                "ck.update_begin() after backward and before optimizer.step()")
            if self._job is not None and self._job.capturing:
                # reported by the HookOrderError itself
                self._job.fail_reported(HookOrderError(self._hook_error))
            return
        job = self._job
        if job is None or not job.capturing or job.error is not None or self.adapter is None:
            return
        j = self._boundary - job.start_boundary + 1
        if j >= job.k:
            return  # this update produces version F + 1: not needed
        t0 = time.perf_counter()
        try:
            self._record_step(job, j)
        except BaseException as exc:
            job.fail(exc)
        finally:
            job.metrics.add_blocked("optimizer_step", time.perf_counter() - t0)

    def _record_step(self, job: Job, j: int) -> None:
        record = self.capture.gradients(job, j, self.grad_pool)
        if record is None:
            return
        if self.config.mode == "gockpt":
            record.ticket.wait()
        else:
            self._grad_tickets.append(record.ticket)
        self.replayer.submit(record, job)

    def _wait_grad_copies(self, hook: Optional[str]) -> None:
        if not self._grad_tickets:
            return
        t0 = time.perf_counter()
        tickets, self._grad_tickets = self._grad_tickets, []
        for t in tickets:
            try:
                t.wait()
            except BaseException as exc:
                if self._job is not None:
                    self._job.fail(exc)
        if hook and self._job is not None:
            self._job.metrics.add_blocked(hook, time.perf_counter() - t0)

    def _zero_grad(self, set_to_none: bool = True):
        if not set_to_none:
            self._wait_grad_copies("zero_grad")
        return self._orig_zero_grad(set_to_none)

    # ------------------------------------------------------------------ finishing

    def _after_replay(self, job: Job) -> None:
        """Every block is at version F (runs on the replay thread, or inline without replay)."""
        if job.error is not None:
            return
        try:
            selfcheck.verify(job, self.plan, self.config.self_check_strict)
        except BaseException as exc:
            job.fail(exc)
            return
        job.metrics.time_to_staged_s = time.perf_counter() - job.t_start
        job.handle._staged.set()
        if self.config.mode == "sync":
            self.persister.persist(job)
        else:
            self.persister.queue_persist(job)

    def block_final(self, job: Job, block: Block) -> None:
        """Replay thread: ``block`` has reached version F (written now if the writer is open)."""
        self.persister.block_final(job, block)

    def _on_durable(self, job: Job) -> None:
        """Persist thread, once ``job`` is committed: measured for ``interval="auto"``."""
        self._finished = (self._finished + [job])[-8:]
        self._durable_count += 1

    def _median_step_time(self) -> float:
        return statistics.median(self._step_times) if self._step_times else 0.0

    # ------------------------------------------------------------------ errors and order

    def _on_job_failed(self, job: Job) -> None:
        with self._errors_lock:
            self._errors.append(job)
        if self.ranks.several and not job.persist_entered and not job.dropped:
            self.persister.queue_persist(job)  # it still votes, so that the other ranks do not wait

    def _raise_pending(self, include_closed: bool = False) -> None:
        try:
            self._raise_pending_now()
        except GockptError:
            self._after_error = True
            raise

    def _raise_pending_now(self) -> None:
        if self._hook_error:
            msg, self._hook_error = self._hook_error, None
            raise HookOrderError(msg)
        with self._errors_lock:
            pending = [j for j in self._errors if not j.handle._reported]
            self._errors = []
        if pending:
            job = pending[0]
            job.handle._reported = True
            raise CheckpointFailedError(
                f"checkpoint of step {job.handle.final_step} failed: {job.error}; the previous "
                "checkpoint stays latest", job.handle.final_step) from job.error

    def _expect(self, hook: str, phase: str) -> None:
        after_error, self._after_error = self._after_error, False
        if hook == "backward_begin" and after_error:
            return  # the step that raised a gockpt error may have been abandoned: start afresh
        if self._phase != phase:
            raise HookOrderError(
                f"{hook}() called in phase '{self._phase}'; each step calls backward_begin(), "
                "loss.backward(), update_begin(), optimizer.step(), save_checkpoint(step) in "
                "this order")

    def _check_open(self) -> None:
        if self._closed:
            raise HookOrderError("this Checkpointer is closed; create a new one to continue")


def _probe_bandwidth() -> float:
    """Host copy bandwidth from one 32 MiB copy (used before any checkpoint measured it)."""
    src = torch.ones(8 << 20)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return src.numel() * 4 / max(time.perf_counter() - t0, 1e-6)


def _checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, storage.checkpoint_name(step))
