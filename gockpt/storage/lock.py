"""One writer per checkpoint directory.

A Checkpointer holds an exclusive ``flock`` on ``<directory>/.gockpt-lock`` for its lifetime
(rank 0 holds it for all the ranks of a job). The lock belongs to the open file, so a second
Checkpointer in the same process is refused like one in another process, and the kernel drops
it when the holding process dies: a ``kill -9`` leaves no stale lock. The file's content (pid,
host, start time, command) only serves to name the holder in the error.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from ..errors import DirectoryInUseError, GockptError, StorageError

LOCK_FILE = ".gockpt-lock"


class DirectoryLock:
    """The writer lock of ``directory`` (acquired on creation, released by :meth:`release`)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: Optional[int] = None
        try:
            # Held read-only: a descriptor open for writing would keep the file system from
            # being remounted read-only (the error must then come from the writes).
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create the lock file {self.path!r}: "
                               f"{exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryInUseError(
                f"checkpoint directory {directory!r} is being written by another Checkpointer "
                f"({holder}); close it first (ck.close()) or give this run its own directory")
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"cannot lock {self.path!r}: {exc.strerror or exc}") from exc
        self._fd = fd
        _write_holder(self.path)

    @classmethod
    def shared(cls) -> "DirectoryLock":
        """What the ranks other than 0 hold: rank 0's lock covers them."""
        lock = cls.__new__(cls)
        lock.path, lock._fd = None, None
        return lock

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race with a new
        holder that has just opened it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file releases the flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def _write_holder(path: str) -> None:
    """Who holds the lock, for the error of the next one who tries (best effort)."""
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
            "argv": sys.argv[:4]}
    try:
        with open(path, "w") as f:
            f.write(json.dumps(info))
    except OSError:
        pass


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on host {info['host']!s:.64}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def lock_for_ranks(directory: str, ranks) -> DirectoryLock:
    """Rank 0 locks the directory for the whole job; every rank learns whether it could."""
    lock, error = None, None
    if ranks.rank == 0:
        try:
            lock = DirectoryLock(directory)
        except GockptError as exc:
            error = exc
    if not ranks.agree_all(error is None):
        if lock is not None:
            lock.release()
        raise error or DirectoryInUseError(
            f"checkpoint directory {directory!r}: rank 0 could not lock it (another "
            "Checkpointer writes it); see rank 0's error")
    return lock or DirectoryLock.shared()
