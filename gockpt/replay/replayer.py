"""The replay thread: applies step records in arrival order, bringing every block captured
before F up to version F.

Records are applied as soon as their gradients have landed, so host memory holds the state plus
the gradients in flight, never K steps of gradients.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from ..core.records import StepRecord

if TYPE_CHECKING:
    from .adapters import AdamAdapter


class _Barrier(NamedTuple):
    """A queue item: run ``callback`` on the replay thread (after what was queued before)."""

    callback: Callable[[], None]


_STOP = object()  # the queue item that ends the thread


class Replayer:
    """Background thread applying step records in arrival order.

    Records are applied as soon as their gradients have landed, so host memory holds the
    state plus the gradients in flight, never K steps of gradients.
    """

    def __init__(self, adapter: AdamAdapter, threads: Optional[int]):
        self.adapter = adapter
        self.threads = threads
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()  # (C-level put: a hook queues)
        self._thread = threading.Thread(target=self._run, name="gockpt-replay", daemon=True)
        self._thread.start()

    def submit(self, record: StepRecord, job) -> None:
        """Queue ``record`` for the checkpoint ``job`` (which owns the host copy)."""
        self._queue.put((record, job))

    def barrier(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the replay thread after everything queued so far."""
        self._queue.put(_Barrier(callback))

    def _run(self):
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _Barrier):
                item.callback()
                continue
            record, job = item
            try:
                record.ticket.wait()
                if job.error is None:
                    t0 = time.perf_counter()
                    self.adapter.apply(record, job.host, self.threads)
                    if record.final and job.on_final is not None:
                        job.on_final(job, record.blocks)  # at F: may be written right away
                    job.metrics.replay_s += time.perf_counter() - t0
            except BaseException as exc:
                job.fail(exc)
            finally:
                record.release()

    def close(self):
        self._queue.put(_STOP)
        self._thread.join()
