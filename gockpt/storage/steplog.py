"""The step log of the memory tier, on its storage side: one entry per training step after the
newest checkpoint, in ``<memory tier's run directory>/log/step-<N>/`` (on several ranks
``log/rank-<r>/step-<N>/``, each rank's own) -- the gradients that
step's update consumed, its small state and the digests of the state after it -- written as a
checkpoint is (a temporary directory renamed into place, every chunk's crc32c in the
manifest, which is written last), on one thread ("gockpt-log") in the order of the steps.

Entries are only ever read as a run of consecutive steps from the checkpoint a restart loads:
a missing, half-written or damaged one ends the run there (:func:`entries_after`). Entries up
to a committed checkpoint are deleted (:meth:`LogWriter.prune`); the log never holds more than
its limit (an entry that does not fit is not written, and the run ends before it until the
next checkpoint prunes).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import warnings
from typing import Callable, List, Optional

from .commit import bytes_under, discard, is_committed
from .memory_tier import write_in_memory

log = logging.getLogger("gockpt")

LOG_DIR = "log"
_ENTRY = re.compile(r"^step-(\d{9,})$")


def entry_name(step: int) -> str:
    return f"step-{step:09d}"


def log_root(memory_root: str, rank: Optional[int] = None) -> str:
    """Where the log lives in the memory tier's run directory: ``log/``, and on several ranks
    each rank's in ``log/rank-<r>/`` (``rank`` given)."""
    root = os.path.join(memory_root, LOG_DIR)
    return root if rank is None else os.path.join(root, f"rank-{rank:05d}")


def _entries(root: str) -> List[tuple]:
    """(step, path) of every committed entry under ``root``, by step."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _ENTRY.match(name)
        if m and is_committed(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def entries_after(root: str, step: int) -> List[str]:
    """The committed entries of steps ``step + 1``, ``step + 2``, ... up to the first missing
    one (a restart from the checkpoint of ``step`` can replay exactly these)."""
    out, want = [], step + 1
    for s, path in _entries(root):
        if s < want:
            continue
        if s != want:
            break
        out.append(path)
        want += 1
    return out


class LogWriter:
    """The thread that writes the entries (persist-like: in order, never blocking training)."""

    def __init__(self, root: str, limit: int):
        self.root, self.limit = root, limit
        os.makedirs(root, exist_ok=True)
        self._bytes = sum(bytes_under(p) for _, p in _entries(root))
        self._full = False  # an entry did not fit: none until the next prune
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()  # (C-level put: a hook queues)
        self._thread = threading.Thread(target=self._run, name="gockpt-log", daemon=True)
        self._thread.start()

    def write(self, step: int, tensors: dict, manifest: dict, first: bool,
              digests: Callable[[], dict], done: threading.Event) -> None:
        """Queue the entry of ``step``, its manifest's ``digests`` given by ``digests()``
        (called on this thread: it may wait for them); ``first``: this process's first
        entry -- those of steps from it on were written by a process that went on from
        another state, and are deleted first. ``done`` is set once it is written (or
        given up)."""
        self._queue.put(("write", step, tensors, manifest, first, digests, done))

    def prune(self, step: int) -> None:
        """Queue deleting the entries up to ``step`` (a checkpoint of it is committed)."""
        self._queue.put(("prune", step))

    def flush(self) -> None:
        """Wait until everything queued is done."""
        done = threading.Event()
        self._queue.put(("call", done.set))
        done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if item[0] == "write":
                    try:
                        self._write(*item[1:-1])
                    finally:
                        item[-1].set()
                elif item[0] == "prune":
                    self._delete(lambda s: s <= item[1])
                    self._full = False
                else:
                    item[1]()
            except Exception as exc:  # noqa: BLE001 -- the log never fails training
                log.warning("gockpt: the step log (%s): %s", self.root, exc)

    def _write(self, step: int, tensors: dict, manifest: dict, first: bool,
               digests: Callable[[], dict]) -> None:
        if first:
            self._delete(lambda s: s >= step)
        manifest = dict(manifest, digests=digests())
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._full or self._bytes + nbytes > self.limit:
            if not self._full:
                warnings.warn(f"gockpt: the step log is full ({self._bytes} of {self.limit} "
                              f"bytes) at step {step}: a restart replays no further until the "
                              "next checkpoint", RuntimeWarning, stacklevel=2)
            self._full = True
            return
        path = write_in_memory(self.root, entry_name(step), tensors, manifest,
                               update_latest=False)
        self._bytes += bytes_under(path)

    def _delete(self, doomed) -> None:
        for s, path in _entries(self.root):
            if doomed(s):
                self._bytes -= bytes_under(path)
                discard(self.root, os.path.basename(path))  # (a reader sees it whole or not)

