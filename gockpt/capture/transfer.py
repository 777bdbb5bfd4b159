"""Copy engine: one priority queue of device-to-host copies.

Gradient copies (small, needed soon by the replay) always go before state copies. On the CPU a
single transfer thread pops copies one pair at a time, so a gradient submitted while a long
state transfer is running waits for at most one block. On a GPU the copies are enqueued on
side streams of different priorities and the thread is not involved.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import List, Sequence, Tuple

import torch

GRADIENT = 0  # priority classes: smaller runs first
STATE = 1


class Ticket:
    """Completion of one submitted group of copies."""

    def __init__(self, n_pairs: int, nbytes: int):
        self.nbytes = nbytes
        self._remaining = n_pairs
        self._event = threading.Event()
        self._cuda_event = None
        self.error = None
        self.seconds = 0.0  # time spent copying (CPU) -- measured by the transfer thread
        if n_pairs == 0:
            self._event.set()

    def done(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self._event.is_set()

    def wait(self) -> None:
        """Block until every copy of this ticket has landed; re-raise a copy error."""
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        else:
            self._event.wait()
        if self.error is not None:
            raise self.error


class CopyEngine:
    """Runs copies ``dst.copy_(src)`` by priority, off the training thread."""

    def __init__(self, device):
        self.device = device
        self.bytes_copied = 0
        self.copy_seconds = 0.0
        self._heap: List[Tuple] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = None
        if not device.asynchronous_copies:
            self._thread = threading.Thread(target=self._run, name="gockpt-transfer", daemon=True)
            self._thread.start()

    def submit(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], priority: int) -> Ticket:
        """Queue copies; returns a ticket to wait on. ``pairs`` are (host dst, device src)."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        ticket = Ticket(len(pairs), nbytes)
        if not pairs:
            return ticket
        if self.device.asynchronous_copies:
            ticket._cuda_event = self.device.enqueue(pairs, high_priority=priority == GRADIENT)
            self.bytes_copied += nbytes
            return ticket
        with self._cv:
            if self._closed:
                raise RuntimeError("gockpt transfer engine is closed")
            for dst, src in pairs:
                heapq.heappush(self._heap, (priority, next(self._seq), dst, src, ticket))
            self._cv.notify()
        return ticket

    def bandwidth(self) -> float:
        """Measured copy bandwidth in bytes/s (0 before any copy)."""
        return self.bytes_copied / self.copy_seconds if self.copy_seconds > 0 else 0.0

    def _run(self):
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, dst, src, ticket = heapq.heappop(self._heap)
            t0 = time.perf_counter()
            try:
                if ticket.error is None:
                    self.device.copy(dst, src)
            except BaseException as exc:  # surfaced to the waiter, never lost
                ticket.error = exc
            dt = time.perf_counter() - t0
            ticket.seconds += dt
            self.copy_seconds += dt
            self.bytes_copied += src.numel() * src.element_size()
            ticket._remaining -= 1
            if ticket._remaining == 0:
                ticket._event.set()

    def close(self) -> None:
        """Finish queued copies and stop the transfer thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
