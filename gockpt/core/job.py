"""One checkpoint in flight: the handle the caller holds and the job behind it.

A job lives through explicit states::

    CAPTURING -> CAPTURED -> STAGED -> DURABLE
        \\------------\\----------\\---> FAILED     (any thread, through Job.fail)
         \\-----------------------------> DROPPED    (close() before F was reached)

Its window is K steps: the checkpoint starts at boundary N (``start_boundary``) and holds
version F, the state right after the update of boundary ``f_boundary = N + K - 1``. Each stage
keeps its own part of the book-keeping in its own object (``job.capture`` written by the
capture stage, ``job.samples`` by :mod:`gockpt.replay.selfcheck`, ``job.stream`` by
:mod:`gockpt.storage.persist`), so that no field is written by two stages; the job alone moves
the state and releases the handle's events (its :class:`Progress`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
import os
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from . import metrics as metrics_mod
from .blocks import Block, BlockTable
from .errors import CheckpointFailedError, WaitTimeoutError
from .latch import Latch

log = logging.getLogger("gockpt")

# A wait looks every WAIT_SLICE_S at whether it can complete the checkpoint itself (the loop's
# thread has ended); one that lasts LONG_WAIT_S says once in the log what it is waiting for.
WAIT_SLICE_S = 1.0
LONG_WAIT_S = 60.0


class State(enum.Enum):
    CAPTURING = "capturing"   # blocks are still being copied during training steps
    CAPTURED = "captured"     # every block copied; replay / self-check / persist in progress
    STAGED = "staged"         # version F complete and consistent in host memory
    DURABLE = "durable"       # written, fsynced, committed
    FAILED = "failed"
    DROPPED = "dropped"       # abandoned at close() before F: nothing of it is visible


class Progress:
    """How far one checkpoint got, shared by its handle (which waits on it) and its job (its
    only writer): ``staged`` and ``durable`` events, the ``error`` it failed with, whether that
    error was ``reported`` already, and ``on_wait``: set by the Checkpointer once the
    checkpoint's step is reached, it copies what is left right away when a wait is called
    where the training loop cannot make them any more -- a wait from its own thread, or once
    that thread has ended --, so that a wait never hangs on steps that will not come (a save at
    the last step); ``pending``: what the checkpoint still waits for, in words."""

    def __init__(self):
        self.staged = Latch()
        self.durable = Latch()
        self.error: Optional[BaseException] = None
        self.reported = False
        self.on_wait: Optional[Callable[[], None]] = None
        self.pending: Optional[Callable[[], str]] = None


class CheckpointHandle:
    """A checkpoint in flight, as the caller sees it. ``final_step`` is known when it starts."""

    def __init__(self, final_step: int, path: str, progress: Optional[Progress] = None):
        self.final_step = final_step
        self.path = path
        self.progress = progress if progress is not None else Progress()

    @property
    def error(self) -> Optional[BaseException]:
        """Why the checkpoint failed (None: it has not)."""
        return self.progress.error

    def done(self) -> bool:
        """True once the checkpoint is durable (or has failed)."""
        return self.progress.durable.is_set()

    def wait_staged(self, timeout: Optional[float] = None) -> None:
        """Block until version F is complete and consistent in host memory (see :meth:`wait`)."""
        self._wait(self.progress.staged, timeout, "staged")

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the checkpoint is written, fsynced and committed; re-raise its error.

        From any thread. With ``timeout`` (seconds), :class:`~gockpt.WaitTimeoutError` at its end
        says what the checkpoint still waits for (it goes on). A checkpoint whose last copies
        the training loop makes (at its next ``update_begin()``, or ``close()``) is completed
        by the wait itself from the loop's own thread, or from any thread once the loop's
        thread has ended; a wait from another thread while the loop runs waits for the loop
        (and says so in the log after a minute)."""
        self._wait(self.progress.durable, timeout, "durable")

    def _wait(self, event: Latch, timeout: Optional[float], what: str) -> None:
        start = time.monotonic()
        told = False
        while True:
            if self.progress.on_wait is not None:
                self.progress.on_wait()  # (at each slice: the loop's thread may have ended)
            waited = time.monotonic() - start
            if event.is_set() or self.error is not None:
                break
            if timeout is not None and waited >= timeout:
                pending = self.progress.pending() if self.progress.pending else ""
                raise WaitTimeoutError(
                    f"checkpoint of step {self.final_step} is not {what} after {timeout:g} s"
                    + (f": it waits for {pending}" if pending else ""), self.final_step)
            if waited >= LONG_WAIT_S and self.progress.pending and not told:
                told = True
                log.warning("gockpt: waiting %.0f s for the checkpoint of step %d: it waits "
                            "for %s", waited, self.final_step, self.progress.pending())
            event.wait(WAIT_SLICE_S if timeout is None else
                       max(0.0, min(WAIT_SLICE_S, timeout - waited)))
        if self.error is not None:
            self.progress.reported = True
            raise CheckpointFailedError(
                f"checkpoint of step {self.final_step} failed: {self.error}",
                self.final_step) from self.error

    def __repr__(self):
        state = "failed" if self.error else "durable" if self.done() else \
            "staged" if self.progress.staged.is_set() else "in flight"
        return f"CheckpointHandle(final_step={self.final_step}, {state}, path={self.path!r})"


@dataclass
class CaptureBook:
    """What the capture stage has queued and landed (written by gockpt.capture only)."""

    groups: List[List[Block]]
    """Group j (1-based) is copied during step j of the window."""
    parts: List[List[Block]] = field(default_factory=list)
    """The blocks whose copy has landed, list by list in capture order (a group's own list,
    the blocks copied at F): :attr:`captured` joins them (landing a group, a hook, costs no
    step per block)."""
    landed: List[int] = field(default_factory=list)
    """Groups whose copy has landed, in order (the blocks at F are not a group)."""
    tickets: Dict[int, object] = field(default_factory=dict)
    """Transfer ticket of each group's state copies."""
    grad_tickets: List = field(default_factory=list)
    recorded: Set[Tuple[int, int]] = field(default_factory=set)
    """(window step, planned param group) whose gradients were recorded."""
    reads: Dict[int, object] = field(default_factory=dict)
    """Group j -> the tensors its copies read, with their versions when queued
    (gockpt.capture.copies.Reads)."""
    live_digests: object = None
    """The digests of the live tensors at F (gockpt.capture.copies.LiveDigestBook)."""
    group_tables: Dict[int, BlockTable] = field(default_factory=dict)
    """Group j -> its blocks as a BlockTable (the plan's, built once per K)."""
    landed_tables: Optional[List[BlockTable]] = None
    """Groups 1..j as one BlockTable at index j - 1 (the plan's, built once per K)."""
    at_f_table: Optional[BlockTable] = None
    """The blocks copied directly at F, once copied."""
    _captured_table: tuple = (None, None)  # (what it was built from, the table)

    @property
    def captured(self) -> List[Block]:
        """Blocks whose copy has landed, in capture order (:meth:`captured_table`: as a
        table)."""
        return [b for part in self.parts for b in part]

    @captured.setter
    def captured(self, blocks: List[Block]) -> None:
        self.parts = [list(blocks)]
        self._captured_table = (None, None)

    def table(self, j: int) -> BlockTable:
        """Group j as a BlockTable (built once)."""
        if j not in self.group_tables:
            self.group_tables[j] = BlockTable(self.groups[j - 1])
        return self.group_tables[j]

    def captured_table(self) -> BlockTable:
        """``captured`` as a BlockTable: the plan's table of the groups landed so far where
        they landed in order (the usual case), else derived from the groups' tables (no loop
        per block); kept until another part lands."""
        key = (len(self.parts), len(self.landed), self.at_f_table is None)
        if self._captured_table[0] != key:
            n = len(self.landed)
            if self.landed_tables is not None and self.at_f_table is None and n and \
                    self.landed == list(range(1, n + 1)):
                table = self.landed_tables[n - 1]
            else:
                at_f = [self.at_f_table] if self.at_f_table is not None else []
                table = BlockTable.concat([self.table(j) for j in self.landed] + at_f)
            self._captured_table = (key, table)
        return self._captured_table[1]


@dataclass
class StreamBook:
    """Streaming persistence of this job (written by gockpt.storage.persist only)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    writer: object = None
    written: Set[Block] = field(default_factory=set)
    waiting: List[Block] = field(default_factory=list)
    """Blocks at F that reached it before the writer opened."""
    entered: bool = False
    """The persist step has started (it runs once)."""
    layout: object = None
    """Which stored tensor holds which host range (gockpt.storage.layout.StoredLayout)."""
    manifest: object = None
    """The manifest committed (plain JSON), for the memory tier's copy."""


class Job:
    """Book-keeping of one checkpoint (created and driven by the Checkpointer)."""

    def __init__(self, start_step: int, k: int, start_boundary: int, groups, mode: str,
                 path: str, host=None, plan=None, tables=None, landed_tables=None):
        self.k = k
        self.start_boundary = start_boundary
        self.f_boundary = start_boundary + k - 1
        self.state = State.CAPTURING
        self.error: Optional[BaseException] = None
        self.t_start = time.perf_counter()
        self.progress = Progress()
        """What the handle waits on (written here only)."""
        self.handle = CheckpointHandle(start_step + k - 1, path, self.progress)
        self.named = False  # the caller named it (save_checkpoint(name=...)): never renamed
        self.metrics = metrics_mod.CheckpointMetrics(start_step, start_step + k - 1, mode, k)
        self.host = host
        self.plan = plan
        """The plan this checkpoint was started with (a re-plan affects later ones only)."""
        self.capture = CaptureBook(groups)
        if tables is not None:  # the plan's (built once per K): group j is tables[j - 1]
            self.capture.group_tables = {j + 1: t for j, t in enumerate(tables)}
            self.capture.landed_tables = landed_tables
        self.stream = StreamBook()
        self.samples: List = []
        """Self-check samples: (block, direct copies at F) (written by gockpt.replay.selfcheck
        only: taken at F, compared and dropped after the replay)."""
        self.accounts_closed = Latch()
        """Set once no hook will charge blocked time to this job any more: its metrics are
        final (the persister waits for it before committing them)."""
        self.on_fail: Optional[Callable[["Job"], None]] = None
        self.on_final: Optional[Callable[["Job", List[Block]], None]] = None
        """Called with blocks as they reach F (streaming persistence), if set."""
        self.small = None
        """The small state at F as the manifest stores it (a gockpt.storage.schema.SmallSection,
        set by the pipeline at the boundary of F; None before)."""
        self.small_tensors: Dict[str, torch.Tensor] = {}
        """The stored tensors the small state refers to (copies taken at F)."""
        self.aligned: Dict[int, tuple] = {}
        """Optimizer state index -> the state keys the blocks carry (set at F)."""
        self.digests: Dict[Tuple[int, Optional[str]], str] = {}
        """(slot, None for the parameter or a state key) -> the digest of that tensor at F,
        verified against the staged copy (set by the pipeline before the job is staged; the
        manifest stores them)."""

    # ------------------------------------------------------------------ the window

    def window_step(self, boundary: int) -> int:
        """1-based index, within the window, of the training step that follows ``boundary``:
        its update_begin waits for group ``window_step`` and its update produces version
        ``start + window_step - 1``."""
        return boundary - self.start_boundary + 1

    def is_final_boundary(self, boundary: int) -> bool:
        """Whether ``boundary`` is the one right after the update that produces version F."""
        return boundary == self.f_boundary

    @property
    def capturing(self) -> bool:
        return self.state is State.CAPTURING

    @property
    def dropped(self) -> bool:
        return self.state is State.DROPPED

    # ------------------------------------------------------------------ transitions

    def captured(self) -> None:
        """Every block has been copied."""
        if self.state is State.CAPTURING:
            self.state = State.CAPTURED

    def staged(self) -> None:
        """Version F is complete and consistent in host memory."""
        if self.error is None:
            self.state = State.STAGED
            self.progress.staged.set()

    def durable(self, path: str) -> None:
        """Committed at ``path``."""
        self.handle.path = path
        self.state = State.DURABLE
        self.progress.durable.set()

    def fail(self, exc: BaseException) -> None:
        """Fail the checkpoint (any thread; the first error wins and aborts the writer)."""
        if self.error is None:
            self.error = exc
            self.progress.error = exc
            self.state = State.FAILED
            with self.stream.lock:
                if self.stream.writer is not None:
                    self.stream.writer.abort()
            if self.on_fail:
                self.on_fail(self)
        self.accounts_closed.set()
        self.progress.staged.set()
        self.progress.durable.set()

    def fail_reported(self, exc: BaseException) -> None:
        """Fail with an error that the caller raises right away (so it is reported once)."""
        self.fail(exc)
        self.progress.reported = True

    def drop(self) -> None:
        """Abandon a checkpoint that still needed training steps (or whose step was not asked
        for after all): nothing of it is visible."""
        self.state = State.DROPPED
        self.error = CheckpointFailedError("dropped")  # every stage leaves it alone from now
        with self.stream.lock:
            if self.stream.writer is not None:
                self.stream.writer.abort()
        self.accounts_closed.set()
        self.progress.error = CheckpointFailedError("dropped at close()")
        self.progress.reported = True
        self.progress.staged.set()
        self.progress.durable.set()

    @property
    def name(self) -> str:
        """The checkpoint's directory name (``step-<F>`` unless the caller named it)."""
        return os.path.basename(self.handle.path)

    def renamed(self, final_step: int, path: Optional[str]) -> None:
        """The step passed at F differs from the expected one: the checkpoint takes its name."""
        self.handle.final_step = self.metrics.final_step = final_step
        if path is not None:  # None: a name the caller chose stays
            self.handle.path = path

    @property
    def reported(self) -> bool:
        return self.progress.reported

    def mark_reported(self) -> None:
        self.progress.reported = True
