"""One checkpoint in flight: the handle the caller holds and the book-keeping behind it.

The job is shared by the training-loop hooks, the transfer, replay and persist threads; it is
the one place that knows whether the checkpoint failed, so every thread fails it through
:meth:`Job.fail` and the handle's events are always released.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from . import metrics as metrics_mod
from .errors import CheckpointFailedError
from .capture.plan import Block


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


class Job:
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

    def fail_reported(self, exc: BaseException) -> None:
        """Fail with an error that the caller raises right away (so it is reported once)."""
        self.fail(exc)
        self.handle._reported = True

    def drop(self) -> None:
        """Abandon a checkpoint that still needed training steps: nothing of it is visible."""
        self.capturing = False
        self.dropped = True
        with self.stream_lock:
            if self.writer is not None:
                self.writer.abort()
        self.handle.error = CheckpointFailedError("dropped at close()")
        self.handle._reported = True
        self.handle._staged.set()
        self.handle._durable.set()
