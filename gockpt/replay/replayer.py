"""The replay thread: applies step records in arrival order, bringing every block captured
before F up to version F.

Records are applied as soon as their gradients have landed, so host memory holds the state plus
the gradients in flight, never K steps of gradients.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Optional

from ..core.records import StepRecord

if TYPE_CHECKING:
    from .adapters import AdamAdapter


class Replayer:
    """Background thread applying step records in arrival order.

    Records are applied as soon as their gradients have landed, so host memory holds the
    state plus the gradients in flight, never K steps of gradients.
    """

    def __init__(self, adapter: AdamAdapter, threads: Optional[int]):
        self.adapter = adapter
        self.threads = threads
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gockpt-replay", daemon=True)
        self._thread.start()

    def submit(self, record: StepRecord, job) -> None:
        """Queue ``record`` for the checkpoint ``job`` (which owns the host copy)."""
        self._queue.put((record, job))

    def barrier(self, callback) -> None:
        """Run ``callback()`` on the replay thread after everything queued so far."""
        self._queue.put((None, callback))

    def _run(self):
        while True:
            record, job = self._queue.get()
            if record is None and job is None:
                return
            if record is None:
                job()
                continue
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
        self._queue.put((None, None))
        self._thread.join()
