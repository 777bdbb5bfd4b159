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
"""

from __future__ import annotations

import logging
import os
import math
import queue
import shutil
import random
import statistics
import threading
import time
import warnings
from typing import Callable, Dict, List, Optional, Union

import torch

from . import metrics as metrics_mod
from . import smallstate, storage, tree
from .config import Config
from .device import device_for
from .errors import (CheckpointFailedError, ConfigError, ConsistencyError, GockptError,
                     HookOrderError, StorageError)
from .plan import Block, build_plan, flat
from .ranks import Ranks
from .replay import Replayer, StepRecord, adapter_for
from .staging import GradPool, HostCopy
from .transfer import GRADIENT, STATE, CopyEngine

log = logging.getLogger("gockpt")

# Loop phases: which hook may come next.
_IDLE, _BACKWARD, _UPDATE = "idle (after save_checkpoint)", "backward", "update"


class CheckpointHandle:
    """A checkpoint in flight. ``final_step`` is known when it starts."""

    def __init__(self, final_step: int, path: str):
        self.final_step = final_step
        self.path = path
        self.error: Optional[BaseException] = None
        self._staged = threading.Event()
        self._durable = threading.Event()
        self._reported = False

    def done(self) -> bool:
        """True once the checkpoint is durable (or has failed)."""
        return self._durable.is_set()

    def wait_staged(self, timeout: Optional[float] = None) -> None:
        """Block until version F is complete and consistent in host memory."""
        self._staged.wait(timeout)
        self._raise()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the checkpoint is written, fsynced and committed; re-raise its error."""
        self._durable.wait(timeout)
        self._raise()

    def _raise(self):
        if self.error is not None:
            self._reported = True
            raise CheckpointFailedError(
                f"checkpoint of step {self.final_step} failed: {self.error}",
                self.final_step) from self.error

    def __repr__(self):
        state = "failed" if self.error else "durable" if self.done() else \
            "staged" if self._staged.is_set() else "in flight"
        return f"CheckpointHandle(final_step={self.final_step}, {state}, path={self.path!r})"


class _Job:
    """Book-keeping of one checkpoint (owned by the Checkpointer)."""

    def __init__(self, start_step, k, start_boundary, groups, mode, state_bytes, path):
        self.k = k
        self.start_boundary = start_boundary
        self.f_boundary = start_boundary + k - 1
        self.groups: List[List[Block]] = groups
        self.captured: List[Block] = []
        self.tickets: Dict[int, object] = {}
        self.grad_tickets: List = []
        self.recorded = set()
        self.capturing = True
        self.small = None            # manifest parts frozen at F
        self.small_tensors: Dict[str, torch.Tensor] = {}
        self.aligned: Dict[int, tuple] = {}
        self.samples = []
        self.error: Optional[BaseException] = None
        self.t_start = time.perf_counter()
        self.handle = CheckpointHandle(start_step + k - 1, path)
        self.metrics = metrics_mod.CheckpointMetrics(start_step, start_step + k - 1, mode, k,
                                                     state_bytes=state_bytes)
        self.host = None
        self.on_fail: Optional[Callable] = None
        self.persist_entered = False
        self.dropped = False
        # Streaming: blocks at version F are written while others still replay.
        self.writer = None
        self.stream_lock = threading.Lock()
        self.written = set()
        self.final_blocks: List[Block] = []   # at F, waiting for the writer to open
        self.on_final: Optional[Callable] = None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.handle.error = exc
            with self.stream_lock:
                if self.writer is not None:
                    self.writer.abort()
            if self.on_fail:
                self.on_fail(self)
        self.capturing = False
        self.handle._staged.set()
        self.handle._durable.set()


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
        _ensure_writable(self.config.directory)
        storage.cleanup_temporaries(self.config.directory)

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
        self._persist_q: "queue.Queue" = queue.Queue()
        self._persister = threading.Thread(target=self._persist_loop, name="gockpt-persist",
                                           daemon=True)
        self._persister.start()

        self._phase = _IDLE
        self._boundary = 0
        self._steps_seen = 0
        self._job: Optional[_Job] = None
        self._last: Optional[_Job] = None
        self._grad_tickets: List = []
        self._errors: List[_Job] = []
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
        self._finished: List[_Job] = []   # durable jobs, for interval="auto"

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
                    self._enqueue_group(job, j_next)
            except GockptError as exc:
                self._fail_now(job, exc)
                raise
            except Exception as exc:
                self._fail_now(job, exc)
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
        last = self._last
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
                    self._capture_rest(job)
                    self._finish_capture(job)
                else:
                    warnings.warn(
                        f"gockpt: checkpoint of step {job.handle.final_step} was still being "
                        "captured at close() (training stopped before its final step); it is "
                        "dropped and the previous checkpoint stays latest", stacklevel=2)
                    job.capturing = False
                    job.dropped = True
                    with job.stream_lock:
                        if job.writer is not None:
                            job.writer.abort()
                    job.handle.error = CheckpointFailedError("dropped at close()")
                    job.handle._reported = True
                    job.handle._staged.set()
                    job.handle._durable.set()
            self._wait_grad_copies(None)
            if self.replayer is not None:
                self.replayer.close()
            self._persist_q.put(None)
            self._persister.join()
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
        job = _Job(step, k, self._boundary, groups, self.config.mode,
                   0, _checkpoint_path(self.config.directory, step + k - 1))
        job.host = self.host
        job.on_fail = self._on_job_failed
        if not self.ranks.several and self.config.mode != "sync":
            job.on_final = self.block_final
        job.metrics.add_blocked("save_checkpoint_busy_wait", waited)
        self._declare_state_keys(job)
        job.metrics.state_bytes = self._job_state_bytes()
        self._job = self._last = job

        t0 = time.perf_counter()
        try:
            if k == 1:
                self._capture_small(job, step, extra_state)
            self._enqueue_group(job, 1)
            if self.config.mode in ("sync", "async"):
                self._capture_rest(job)
        except GockptError as exc:
            self._fail_now(job, exc)
            raise
        except Exception as exc:
            self._fail_now(job, exc)
            raise CheckpointFailedError(f"checkpoint at step {step} could not start: {exc}",
                                        step) from exc
        finally:
            # Accounted before the job can reach the writer, which records the metrics.
            job.metrics.add_blocked("save_checkpoint", time.perf_counter() - t0)
        if self.config.mode in ("sync", "async"):
            self._finish_capture(job)  # sync: persists inline, the time counted by _persist
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
        params = sum(s.numel * s.param.element_size() for s in self.plan.slots)
        opt = sum(s.numel * s.param.element_size() for s in self.plan.slots if not s.static)
        if self.config.replays:
            return params + 2 * opt + GradPool.SIZE * opt
        return params + 2 * opt  # Adam-like optimizers: two aligned state tensors

    def _choose_k(self) -> int:
        fixed = self.config.fixed_overlap_steps()
        if fixed is not None:
            return fixed
        if not self._fwd_bwd_times:
            return 2  # nothing measured yet
        fwd_bwd = statistics.median(self._fwd_bwd_times)
        bandwidth = self.engine.bandwidth() or _probe_bandwidth()
        copy_s = self._job_state_bytes(assume_replay=True) / bandwidth
        # Enough steps for the state copies to ride under forward/backward; the paper's
        # analysis finds the best K near 7 on GPUs, beyond which gradient traffic grows
        # faster than the saving.
        return max(1, min(8, math.ceil(copy_s / max(fwd_bwd, 1e-6))))

    def _job_state_bytes(self, assume_replay: bool = False) -> int:
        if self.host is None or assume_replay:
            return self.plan.state_bytes(2)
        total = 0
        for si, s in enumerate(self.plan.slots):
            total += s.numel * s.param.element_size()
            total += sum(self.host.state[si][k].numel() * self.host.state[si][k].element_size()
                         for k in self.host.keys[si])
        return total

    def _declare_state_keys(self, job: _Job) -> None:
        for si, s in enumerate(self.plan.slots):
            if s.static:
                continue
            if self.adapter is not None:
                self.host.set_keys(si, self.adapter.state_keys, s.param)
            else:
                live = self.optimizer.state.get(s.param, {})
                keys = [k for k, v in live.items() if isinstance(v, torch.Tensor)
                        and k != "step" and v.shape == s.param.shape]
                for k in keys:
                    self.host.set_keys(si, keys, live[k])
                if not keys:
                    self.host.set_keys(si, (), s.param)

    # ------------------------------------------------------------------ capture

    def _enqueue_group(self, job: _Job, j: int) -> None:
        """Queue the copies of group j: they hold the version of the last completed update."""
        pairs = []
        for b in job.groups[j - 1]:
            slot = self.plan.slots[b.slot]
            s, e = b.start, b.end
            pairs.append((self.host.param[b.slot][s:e], flat(slot.param)[s:e]))
            live = self.optimizer.state.get(slot.param, {})
            for key in self.host.keys[b.slot]:
                dst = self.host.state[b.slot][key][s:e]
                if key in live:
                    pairs.append((dst, flat(live[key])[s:e]))
                else:
                    dst.zero_()  # no state yet: the replayed first update starts from zeros
        job.tickets[j] = self.engine.submit(pairs, STATE)

    def _capture_rest(self, job: _Job) -> None:
        """Copy every block not yet captured now, blocking (sync/async, or close())."""
        for j in range(1, job.k + 1):
            if j not in job.tickets:
                self._enqueue_group(job, j)
        for j in range(1, job.k + 1):
            job.tickets[j].wait()
        job.captured = [b for g in job.groups for b in g]
        job.capturing = False

    def _finish_capture(self, job: _Job) -> None:
        """All blocks captured: replay (if any) then self-check and persist."""
        if job.on_final is not None:
            self._persist_q.put(("captured", job))  # the last group is at F: write it
        if self.replayer is not None:
            self.replayer.barrier(lambda: self._after_replay(job))
        else:
            self._after_replay(job)

    def _capture_small(self, job: _Job, step: int, extra_state) -> None:
        """Freeze everything small at the boundary of F (and sample blocks for the self-check)."""
        if step != job.handle.final_step:
            warnings.warn(f"gockpt: expected step {job.handle.final_step} at the final boundary "
                          f"of this checkpoint, got {step}; save_checkpoint should be called "
                          "every step with consecutive step numbers", stacklevel=4)
            job.handle.final_step = job.metrics.final_step = step
            job.handle.path = _checkpoint_path(self.config.directory, step)
        if callable(extra_state):
            extra_state = extra_state()
        aligned = {}
        for si, s in enumerate(self.plan.slots):
            if not s.static and s.param in self.optimizer.state:
                aligned[s.opt_index] = self.host.keys[si]
        job.aligned = aligned
        tensors: Dict[str, torch.Tensor] = {}
        planned = [id(s.param) for s in self.plan.slots]
        try:
            small = {
                "model": tree.encode(smallstate.model_small(self.model, planned), tensors,
                                     "small/model"),
                "optimizer": tree.encode(smallstate.optimizer_small(self.optimizer, aligned),
                                         tensors, "small/optimizer"),
                "scheduler": tree.encode(smallstate.scheduler_state(self.scheduler), tensors,
                                         "small/scheduler"),
                "rng": tree.encode(smallstate.capture_rng(), tensors, "small/rng"),
                "extra_state": tree.encode(extra_state, tensors, "small/extra_state"),
            }
        except TypeError as exc:
            raise ConfigError(f"cannot store the state of step {step}: {exc}") from exc
        job.small, job.small_tensors = small, tensors
        self._sample_for_self_check(job)
        if job.on_final is not None:
            self._persist_q.put(("open", job))

    def _sample_for_self_check(self, job: _Job) -> None:
        frac = self.config.self_check
        replayed = list(job.captured)  # captured before F: their copies get replayed
        if not replayed or frac <= 0 or self.adapter is None:
            return
        n = max(1, round(frac * len(replayed)))
        picks = replayed if n >= len(replayed) else random.Random(job.f_boundary).sample(
            replayed, n)
        for b in picks:
            slot = self.plan.slots[b.slot]
            live = self.optimizer.state.get(slot.param, {})
            direct = {"param": flat(slot.param)[b.start:b.end].to("cpu", copy=True)}
            for key in self.host.keys[b.slot]:
                if key in live:
                    direct[key] = flat(live[key])[b.start:b.end].to("cpu", copy=True)
            job.samples.append((b, direct))

    # ------------------------------------------------------------------ gradients

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Step pre-hook: the gradients are exactly what this update consumes."""
        if self._phase != _UPDATE:
            self._hook_error = (f"optimizer.step() ran in phase '{self._phase}': call "
                                "ck.update_begin() after backward and before optimizer.step()")
            if self._job is not None and self._job.capturing:
                self._job.fail(HookOrderError(self._hook_error))
                self._job.handle._reported = True  # reported by the HookOrderError itself
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

    def _record_step(self, job: _Job, j: int) -> None:
        if self.adapter.skipped_by_scaler():
            return
        why = self.adapter.unsupported_step()
        if why:
            raise ConfigError(f"this optimizer step cannot be replayed: {why}")
        if j in job.recorded:
            raise HookOrderError("optimizer.step() ran twice in one training step; gockpt "
                                 "supports one optimizer step per save_checkpoint() boundary")
        job.recorded.add(j)
        steps = {}
        for si, s in enumerate(self.plan.slots):
            g = s.param.grad
            if s.static or g is None:
                continue
            if g.is_sparse or g.dtype != s.param.dtype or not g.is_contiguous():
                raise ConfigError(f"the gradient of {s.name!r} is sparse, non-contiguous or "
                                  f"{g.dtype}; the replay needs dense {s.param.dtype} gradients")
            steps[si] = self.adapter.step_count(s.param)
        blocks = [b for b in job.captured if b.slot in steps]
        bufs = self.grad_pool.acquire()
        pairs = []
        for b in blocks:
            g = self.plan.slots[b.slot].param.grad
            pairs.append((self.grad_pool.buffer(bufs, b.slot, g)[b.start:b.end],
                          flat(g)[b.start:b.end]))
        ticket = self.engine.submit(pairs, GRADIENT)
        record = StepRecord(j, self.adapter.scalars(), steps, blocks, bufs,
                            torch.get_num_threads(), ticket,
                            lambda bufs=bufs: self.grad_pool.release(bufs), ticket.nbytes,
                            final=j == job.k - 1)
        job.metrics.grad_bytes += ticket.nbytes
        job.grad_tickets.append(ticket)
        if self.config.mode == "gockpt":
            ticket.wait()
        else:
            self._grad_tickets.append(ticket)
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

    def _after_replay(self, job: _Job) -> None:
        """Every block is at version F (runs on the replay thread, or inline without replay)."""
        if job.error is not None:
            return
        try:
            self._self_check(job)
        except BaseException as exc:
            job.fail(exc)
            return
        job.metrics.time_to_staged_s = time.perf_counter() - job.t_start
        job.handle._staged.set()
        if self.config.mode == "sync":
            self._persist(job)
        else:
            self._persist_q.put(("close", job))

    def _self_check(self, job: _Job) -> None:
        bad = []
        for b, direct in job.samples:
            s, e = b.start, b.end
            if not torch.equal(direct["param"], self.host.param[b.slot][s:e]):
                bad.append(f"{self.plan.slots[b.slot].name}[{s}:{e}] (param)")
            for key, ref in direct.items():
                if key != "param" and not torch.equal(ref, self.host.state[b.slot][key][s:e]):
                    bad.append(f"{self.plan.slots[b.slot].name}[{s}:{e}] ({key})")
        job.metrics.self_check_blocks = len(job.samples)
        job.metrics.self_check_mismatches = len(bad)
        job.samples = []
        if bad:
            msg = (f"self-check: {len(bad)} replayed block(s) differ from a direct copy at step "
                   f"{job.handle.final_step}: {', '.join(bad[:5])}")
            if self.config.self_check_strict:
                raise ConsistencyError(msg + "; the checkpoint is not committed")
            warnings.warn("gockpt: " + msg)

    def _persist_loop(self) -> None:
        while True:
            item = self._persist_q.get()
            if item is None:
                return
            what, job = item
            if what == "open":
                self._open_writer(job)
            elif what == "captured":
                self._write_captured(job)
            else:
                self._persist(job)

    # Streaming (single rank): the writer opens at the boundary of F (when the small state and
    # the layout are known); blocks are written as they reach F -- the last group when it is
    # captured, the others as the replay of step F finishes each of them; whatever is left
    # (e.g. a step F skipped by GradScaler) is written at commit time.

    def _layout(self, job: _Job) -> Dict[str, tuple]:
        layout = {}
        for si, s in enumerate(self.plan.slots):
            layout[f"model/{s.name}"] = (s.param.dtype, tuple(s.param.shape))
            for key in (job.aligned.get(s.opt_index, ()) if not s.static else ()):
                layout[f"optim/{s.opt_index}/{key}"] = (self.host.state[si][key].dtype,
                                                        tuple(s.param.shape))
        for name, t in job.small_tensors.items():
            layout[name] = (t.dtype, tuple(t.shape))
        return layout

    def _write_block(self, job: _Job, b: Block) -> None:
        """Queue block ``b`` (caller holds ``job.stream_lock``; writer open)."""
        if b in job.written:
            return
        job.written.add(b)
        s = self.plan.slots[b.slot]
        job.writer.write(f"model/{s.name}", self.host.param[b.slot][b.start:b.end],
                         start=b.start)
        for key in (job.aligned.get(s.opt_index, ()) if not s.static else ()):
            job.writer.write(f"optim/{s.opt_index}/{key}",
                             self.host.state[b.slot][key][b.start:b.end], start=b.start)

    def _open_writer(self, job: _Job) -> None:
        if job.error is not None or job.dropped:
            return
        try:
            writer = storage.CheckpointWriter(self.config.directory,
                                              storage.checkpoint_name(job.handle.final_step))
            try:
                writer.begin(self._layout(job))
                for name, t in job.small_tensors.items():
                    writer.write(name, t)
            except BaseException:
                writer.abort()
                raise
            with job.stream_lock:
                job.writer = writer
                for b in job.final_blocks:
                    self._write_block(job, b)
        except BaseException as exc:
            job.fail(exc if isinstance(exc, GockptError) else StorageError(
                f"opening the checkpoint of step {job.handle.final_step} in "
                f"{self.config.directory} failed: {exc}"))

    def _write_captured(self, job: _Job) -> None:
        """Every block is captured: the last group (copied at F) and static ones are final."""
        with job.stream_lock:
            if job.writer is None or job.error is not None:
                return
            try:
                for b in job.groups[-1]:
                    self._write_block(job, b)
                for b in job.captured:
                    if self.plan.slots[b.slot].static:
                        self._write_block(job, b)
            except BaseException as exc:
                err = exc
            else:
                return
        job.fail(err)

    def block_final(self, job: _Job, block: Block) -> None:
        """Replay thread: ``block`` has reached version F."""
        with job.stream_lock:
            if job.writer is None:
                job.final_blocks.append(block)
            elif job.error is None:
                self._write_block(job, block)

    def _persist(self, job: _Job) -> None:
        """Write, fsync and commit version F (on several ranks: together, see ranks.py)."""
        if job.persist_entered:
            return
        job.persist_entered = True
        t0 = time.perf_counter()
        writer = None
        name = storage.checkpoint_name(job.handle.final_step)
        try:
            if self.ranks.several:
                write_part = None if job.error is not None else \
                    (lambda shared: self._write(job, shared, self.ranks.part_name(), t0,
                                                update_latest=False))
                top = {"step": job.handle.final_step, "start_step": job.metrics.start_step,
                       "mode": self.config.mode, "overlap_steps": job.k}
                path = self.ranks.commit(self.config.directory, name, write_part, top)
                if job.error is not None:
                    return
            else:
                with job.stream_lock:
                    writer = job.writer
                if writer is None:
                    writer = storage.CheckpointWriter(self.config.directory, name)
                path = self._write(job, None, name, t0, writer=writer)
            job.handle.path = path
            m = job.metrics
            m.time_to_durable_s = time.perf_counter() - job.t_start
            if self.ranks.rank == 0:
                metrics_mod.append(self.config.directory, m)
                self._apply_retention()
            self._finished = (self._finished + [job])[-8:]
            self._durable_count += 1
            log.info("gockpt: checkpoint of step %d durable at %s", job.handle.final_step, path)
            job.handle._durable.set()
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            if not isinstance(exc, GockptError):
                exc = StorageError(f"writing the checkpoint of step {job.handle.final_step} to "
                                   f"{self.config.directory} failed: {exc}")
            job.fail(exc)

    def _write(self, job: _Job, root: Optional[str], name: str, t0: float, *, writer=None,
               update_latest: bool = True) -> str:
        """Write this process's tensors and manifest as checkpoint ``name`` in ``root``."""
        tensors = {}
        for si, s in enumerate(self.plan.slots):
            tensors[f"model/{s.name}"] = self.host.param[si].view(s.param.shape)
        for si, s in enumerate(self.plan.slots):
            for key in job.aligned.get(s.opt_index, ()) if not s.static else ():
                tensors[f"optim/{s.opt_index}/{key}"] = \
                    self.host.state[si][key].view(s.param.shape)
        tensors.update(job.small_tensors)
        if writer is None:
            writer = storage.CheckpointWriter(root, name)
        try:
            if job.writer is writer and writer is not None:
                with job.stream_lock:  # streamed: write only what is left
                    for b in job.captured:
                        self._write_block(job, b)
                writer.finish()
            else:
                writer.write_tensors(tensors)
            m = job.metrics
            m.copy_s = sum(t.seconds for t in list(job.tickets.values()) + job.grad_tickets)
            m.persist_s = time.perf_counter() - t0
            if self.config.mode == "sync":  # the write happened inside save_checkpoint
                m.add_blocked("save_checkpoint", m.persist_s)
            m.time_to_durable_s = time.perf_counter() - job.t_start
            m.step_time_s = statistics.median(self._step_times) if self._step_times else 0.0
            m.host_bytes = self.host_bytes
            manifest = {
                "step": job.handle.final_step,
                "start_step": m.start_step,
                "mode": self.config.mode,
                "overlap_steps": job.k,
                "rank": self.ranks.rank,
                "world_size": self.ranks.world_size,
                "model": {"params": {s.name: f"model/{s.name}" for s in self.plan.slots},
                          "aliases": self.plan.aliases},
                "optimizer": {"class": type(self.optimizer).__name__,
                              "aligned": {str(i): list(k) for i, k in job.aligned.items()}},
                "small": job.small,
                "metrics": m.to_dict(),
            }
            t_commit = time.perf_counter()
            path = writer.commit(manifest, update_latest=update_latest)
            if self.config.mode == "sync":
                m.add_blocked("save_checkpoint", time.perf_counter() - t_commit)
            return path
        except BaseException:
            writer.abort()
            raise

    def _apply_retention(self) -> None:
        """Delete committed checkpoints beyond ``keep_last`` (after a newer one committed)."""
        keep = self.config.keep_last
        if keep is None:
            return
        names = storage.list_checkpoints(self.config.directory)
        latest = os.path.basename(storage.resolve(self.config.directory))
        for name in [n for n in names if n != latest][:max(0, len(names) - keep)]:
            # Rename first so the deletion is atomic for readers; a crash mid-delete leaves
            # a .tmp-* entry that cleanup_temporaries removes.
            doomed = os.path.join(self.config.directory,
                                  f"{storage.TMP_PREFIX}{name}.old-{os.getpid()}-{os.urandom(4).hex()}")
            try:
                os.rename(os.path.join(self.config.directory, name), doomed)
                shutil.rmtree(doomed, ignore_errors=True)
            except OSError as exc:
                log.warning("gockpt: could not delete old checkpoint %s: %s", name, exc)

    # ------------------------------------------------------------------ errors and order

    @staticmethod
    def _fail_now(job: _Job, exc: BaseException) -> None:
        """Fail ``job`` with an error that the caller raises right away (reported once)."""
        job.fail(exc)
        job.handle._reported = True

    def _on_job_failed(self, job: _Job) -> None:
        with self._errors_lock:
            self._errors.append(job)
        if self.ranks.several and not job.persist_entered and not job.dropped:
            self._persist_q.put(("close", job))  # it still votes, so that the other ranks do not wait

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


def _ensure_writable(directory: str) -> None:
    """Fail at construction, not at the first checkpoint, when the directory is unusable."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".gockpt-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise StorageError(
            f"checkpoint directory {directory!r} is not a writable directory ({exc.strerror or exc}); "
            "pass a path you can write to") from exc
