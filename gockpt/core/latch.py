"""A ``threading.Event`` that is set once and never cleared, made of one raw lock.

Each checkpoint makes three (its handle's ``staged`` and ``durable``, the end of its blocked
time) on the training thread, at the boundary that starts its window. A ``threading.Event``
is a ``Condition`` around a lock, several Python objects and calls: after a training
step has evicted them from the CPU caches each costs ~10-15 µs there; a latch costs one lock.
"""

from __future__ import annotations

import _thread
import os
import threading
from typing import Optional

_SETTING = _thread.allocate_lock()  # (set() from two threads at once releases the lock once)


def _new_setting_lock() -> None:  # (a child forked while another thread held it)
    global _SETTING
    _SETTING = _thread.allocate_lock()


os.register_at_fork(after_in_child=_new_setting_lock)


class Latch:
    """``set()``, ``is_set()`` and ``wait(timeout)`` as ``threading.Event`` has them; no
    ``clear()``. Its lock is held from its creation until ``set()``: a waiter acquires it
    and hands it back at once, so that every waiter passes once it is set."""

    __slots__ = ("_flag", "_lock")

    def __init__(self):
        self._flag = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with _SETTING:
            if not self._flag:
                self._flag = True  # (before the release: whoever it wakes sees it set)
                self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until set, or for at most ``timeout`` seconds; whether it is set."""
        if self._flag:
            return True
        limit = -1 if timeout is None else min(max(0.0, timeout), threading.TIMEOUT_MAX)
        if self._lock.acquire(timeout=limit):
            self._lock.release()
            return True
        return self._flag

    def __repr__(self) -> str:
        return f"<Latch {'set' if self._flag else 'unset'}>"
