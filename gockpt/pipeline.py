"""One checkpoint through the pipeline, stage by stage:

    capture (copies of groups, small state at F, gradients)  ->  replay to F  ->  self-check
    ->  persist (streamed blocks, commit)

The Checkpointer's hooks call these at the right moments of the training loop; the stages
themselves live in ``capture/``, ``replay/`` and ``storage/``. Errors raised here at a step
boundary fail the job and are raised to the training loop at once (reported once) -- except
an optimizer state found replaced at F: that checkpoint alone is not committed, with a
warning (gockpt.loop), and the next one reads the new state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable, List, Optional

from .capture.copies import Capture
from .core.digest import LiveDigests
from .core.config import Config
from .core.errors import (Adaptation, CheckpointFailedError, ConfigError, ConsistencyError,
                          GockptError)
from .core.job import Job
from .core.modes import GRADS_IN_STEP
from .replay import selfcheck
from .replay.replayer import Replayer
from .core.staging import window_bytes
from .storage.format import checkpoint_name
from .storage.persist import Persister
from .storage.schema import SmallSection

log = logging.getLogger("gockpt")


class Pipeline:
    """Moves jobs through capture -> replay -> self-check -> persist."""

    def __init__(self, config: Config, capture: Capture, replayer: Optional[Replayer],
                 persister: Persister, path_of: Optional[Callable[[int], str]] = None,
                 digester: Optional[LiveDigests] = None):
        self.config, self.policy = config, config.policy
        self.capture, self.replayer, self.persister = capture, replayer, persister
        # step -> directory of its checkpoint
        self.path_of = path_of or (lambda step: os.path.join(config.directory,
                                                             checkpoint_name(step)))
        self.digester = digester  # None: Config.verify is off
        self._digests_to_wait: List[Job] = []  # live digests the next update must not overtake
        self._window_sizes: tuple = ((), None, 0, None)  # (what window_bytes read, the host
        # copy's keys_version, K, its result)

    def close(self) -> None:
        """Stop the replay thread, then the persist thread (each finishes what it holds)."""
        if self.replayer is not None:
            self.replayer.close()
        self.persister.close()

    # ------------------------------------------------------------------ at boundaries

    def new_job(self, step: int, k: int, boundary: int, plan, host,
                name: Optional[str], waited: float, on_fail, streams_blocks: bool) -> Job:
        """The checkpoint of K steps starting at ``boundary`` (its step F = ``step + k - 1``),
        into ``name`` or the directory of F; ``waited``: seconds the start waited for the
        previous one; ``streams_blocks``: its blocks stream to the writer as they reach F.
        :meth:`begin` starts it."""
        final = step + k - 1
        path = os.path.join(self.config.directory, name) if name is not None \
            else self.path_of(final)
        job = Job(step, k, boundary, plan.groups(k), self.config.mode, path, host=host,
                  plan=plan, tables=plan.group_tables(k), landed_tables=plan.landed_tables(k))
        job.on_fail = on_fail
        job.named = name is not None
        if streams_blocks:
            job.on_final = self.persister.blocks_final
        job.metrics.add_blocked("save_checkpoint_busy_wait", waited)
        self.capture.declare_state_keys(host)
        job.metrics.state_bytes = self.capture.state_bytes(host)
        job.metrics.replayed_bytes, job.metrics.copied_at_f_bytes = self._window_bytes(plan,
                                                                                    host, k)
        log.info("gockpt: checkpoint of step %d: %s", final,
                 f"copied over the {k} steps up to it (K={k}, "
                 f"{'as configured' if self.config.overlap_steps else 'measured'})" if k > 1
                 else "copied under the next step")
        return job

    def _window_bytes(self, plan, host, k: int) -> tuple:
        """:func:`window_bytes`, computed again only when what it reads was replaced (the plan,
        its blocks copied at F, the host copy or its arenas): the same at most checkpoints."""
        read = (plan, plan.at_f_table, host)
        seen, version, seen_k, sizes = self._window_sizes
        if seen_k != k or version != host.keys_version or len(seen) != len(read) or \
                any(a is not b for a, b in zip(seen, read)):
            sizes = window_bytes(plan, host, k)
            self._window_sizes = (read, host.keys_version, k, sizes)
        return sizes

    def begin(self, job: Job, step: int, boundary: int, extra_state) -> None:
        """The boundary that starts ``job``: queue group 1 (everything, blocking, in the
        modes that copy at the start)."""
        try:
            if job.is_final_boundary(boundary):
                self.freeze_small(job, step, extra_state)
            if job.error is not None:
                return
            self.capture.enqueue_group(job, 1)
            if self.policy.copies_at_start:
                self.capture.copy_rest(job)
        except BaseException as exc:
            _fail_now(job, exc, f"checkpoint at step {step} could not start")
        if self.policy.copies_at_start:
            self.finish_capture(job)

    def boundary(self, job: Job, step: int, boundary: int, extra_state,
                 name: Optional[str] = None) -> None:
        """A boundary inside the window: freeze the small state at F (the checkpoint takes the
        step, and ``name``, given there), queue the next group."""
        try:
            if job.is_final_boundary(boundary):
                self.freeze_small(job, step, extra_state, name)
            if job.error is not None:
                return
            j_next = job.window_step(boundary)
            if j_next <= job.k:
                self.capture.enqueue_group(job, j_next)
        except BaseException as exc:
            _fail_now(job, exc, f"checkpoint of step {job.handle.final_step} failed at the "
                      "step boundary")

    def freeze_small(self, job: Job, step: int, extra_state, name: Optional[str] = None) -> None:
        """Freeze everything small at the boundary of F (and sample blocks for the self-check).
        The checkpoint is the step passed here (the one the caller asked for), named ``name``
        when given."""
        if name is not None:
            job.named = True
            job.renamed(step, os.path.join(self.config.directory, name))
        elif step != job.handle.final_step:  # step numbers that are not consecutive
            job.renamed(step, None if job.named else self.path_of(step))
        replaced = self.capture.replaced_states(job)
        if replaced:  # the next checkpoint reads the new state (a warning, not an error)
            job.fail(ConsistencyError(
                f"the optimizer state of {', '.join(replaced[:5])}"
                f"{f' (and {len(replaced) - 5} more)' if len(replaced) > 5 else ''} was "
                "replaced during the checkpoint (optimizer.load_state_dict(), or a state dict "
                "assigned)", adapt=Adaptation.NEW_STATE))
            return
        freeze_small_state(self.capture, job, step, extra_state)
        job.metrics.final_time = time.time()  # (goodput: when the state it holds was reached)
        if self.replayer is not None:
            selfcheck.sample(job, job.plan, self.capture.optimizer, self.config.self_check)
        if self.digester is not None:
            self.capture.digest_live(job, self.digester)
            self._digests_to_wait.append(job)
        at_f = self.capture.copy_at_f(job)
        if job.on_final is not None:
            self.persister.queue_open(job)
            job.on_final(job, at_f)

    # ------------------------------------------------------------------ in a step

    def before_update(self) -> None:
        """update_begin (any job): the live digests taken at the last F must have read the
        state before the optimizer changes it."""
        jobs, self._digests_to_wait = self._digests_to_wait, []
        for job in jobs:
            try:
                job.capture.live_digests.wait_before_update(self.capture.engine.device)
            except BaseException as exc:
                job.fail(exc)

    def land(self, job: Job, j: int) -> None:
        """update_begin of window step ``j``: group j must have landed; after the last group
        every block is captured and the job moves on."""
        try:
            self.capture.land_group(job, j)
        except BaseException as exc:
            job.fail(exc)
        if j >= job.k and job.error is None:
            job.captured()
            self.finish_capture(job)

    def record_gradients(self, job: Job, j: int, groups, grad_pool):
        """Optimizer step pre-hook of window step ``j`` < K, stepping the planned param
        groups ``groups``: copy the consumed gradients and queue their replay. Returns the
        copies' ticket to wait for after the update (gockpt-o), or None."""
        ticket = None
        try:
            record = self.capture.gradients(job, j, groups, grad_pool,
                                            snapshot=self.policy.snapshots_gradients(
                                                self.capture.engine.device))
            if record is not None:
                if self.policy.grad_wait == GRADS_IN_STEP:
                    record.ticket.wait()
                elif not record.snapshot:  # .grad itself is read: order later work after it
                    ticket = record.ticket
                self.replayer.submit(record, job)
        except BaseException as exc:
            job.fail(exc)
        return ticket

    def settle(self, job: Job) -> None:
        """Block until nothing queued for ``job`` can still write its host staging: the copies
        it queued (state groups, gradients, live digests) have landed and the replay thread
        has passed every record of it. A durable job is settled by construction; a failed
        one is not -- its replay may be applying a record it took before the failure -- and
        the next checkpoint copies into the same staging (measured race: that late record
        landed on the next checkpoint's fresh copies, whose verification then failed)."""
        book = job.capture
        tickets = [*book.tickets.values(), *book.grad_tickets]
        for ticket in tickets:
            with contextlib.suppress(Exception):  # the job has failed already
                ticket.wait()
        if book.live_digests is not None:
            for ticket in book.live_digests.tickets():
                ticket.reads_done.wait()
        if self.replayer is not None:
            passed = threading.Event()
            self.replayer.barrier(passed.set)
            passed.wait()

    # ------------------------------------------------------------------ after capture

    def finish_capture(self, job: Job) -> None:
        """All blocks captured: replay (if any) then self-check and persist."""
        if job.on_final is not None:
            self.persister.queue_captured(job)  # the last group is at F: write it
        if self.replayer is not None:
            self.replayer.barrier(lambda: self.after_replay(job))
        elif self.policy.persists_inline:
            self.after_replay(job)
        else:  # the checks of the copy run off the training thread, then the write
            self.persister.queue_call(lambda: self.after_replay(job, on_persist_thread=True))

    def after_replay(self, job: Job, on_persist_thread: bool = False) -> None:
        """Every block is at version F (runs on the replay thread; without a replay on the
        persist thread, or inline in sync mode): checked against the live state, staged,
        then persisted (queued, or right here on the persist thread)."""
        if job.error is not None:
            return
        try:
            job.digests = selfcheck.verify(job, job.plan, self.config.self_check_strict,
                                           replayed=self.replayer is not None,
                                           threads=self.config.replay_threads or 0)
        except BaseException as exc:
            job.fail(exc)
            return
        job.metrics.time_to_staged_s = time.perf_counter() - job.t_start
        job.staged()
        if on_persist_thread:
            self.persister.persist(job)
        elif not self.policy.persists_inline:  # else the Checkpointer persists it after the hook
            self.persister.queue_persist(job)


def freeze_small_state(capture: Capture, job: Job, step: int, extra_state) -> None:
    """At the boundary of F: the small state as the manifest stores it, encoded at once (the
    values are the live objects' at F; encoding copies their tensors, but for the copies made
    by reading them), and the aligned keys, handed to the job. ConfigError for a value that
    cannot be stored without pickle."""
    values, aligned, fresh = capture.small_state(job, extra_state)
    try:
        job.small, job.small_tensors = SmallSection.encode(values, fresh)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot store the state of step {step}: {exc}") from exc
    job.aligned = aligned


def _fail_now(job: Job, exc: BaseException, what: str) -> None:
    """Fail ``job`` with ``exc`` and raise it now (so it is reported once)."""
    job.fail_reported(exc)
    if isinstance(exc, GockptError) or not isinstance(exc, Exception):
        raise exc
    raise CheckpointFailedError(f"{what}: {exc}", job.handle.final_step) from exc
