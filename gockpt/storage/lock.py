"""One writer per checkpoint directory.

A Checkpointer holds an exclusive ``flock`` on ``<directory>/.gockpt-lock`` for its lifetime
(rank 0 holds it for all the ranks of a job). The lock belongs to the open file, so a second
Checkpointer in the same process is refused like one in another process, and the kernel drops
it when the holding process dies: a ``kill -9`` leaves no stale lock.

Two ways a dead writer could still block a restart, and what is done about them:

* **Forked children** (DataLoader workers) inherit the descriptor and, with it, the lock: they
  would keep it for seconds after their parent was killed. A child closes its inherited copy
  right after ``fork()`` (``os.register_at_fork``); the parent's lock is untouched.
* **A holder that is dead but whose lock is still held**: on one host, the pid recorded in the
  lock file no longer runs (or runs another program: its start time differs); on a shared file
  system, the holder's host is another one and its heartbeat (the lock file's mtime, refreshed
  every ``HEARTBEAT_S`` by the holder) is older than ``LEASE_S``. Such a lock is taken over
  with a warning: the lock file is replaced by a new one, which is locked.

Acquisition and take-over both run under a short-lived guard lock (``.gockpt-lock.guard``), so
that a take-over can never replace the file of a holder that has just locked it and not yet
written its record. The record (pid, host, process start time, since, command) is JSON in the
lock file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from typing import Optional

from ..core.errors import DirectoryInUseError, GockptError, StorageError

LOCK_FILE = ".gockpt-lock"
GUARD_FILE = ".gockpt-lock.guard"
#: The holder refreshes its heartbeat (the lock file's mtime) this often ...
HEARTBEAT_S = 10.0
#: ... and a holder on another host whose heartbeat is older than this is taken for dead.
LEASE_S = 120.0
#: The most of the lock file read (a record is a few hundred bytes).
RECORD_BYTES = 4096

log = logging.getLogger("gockpt")
_held: "weakref.WeakSet[DirectoryLock]" = weakref.WeakSet()


class DirectoryLock:
    """The writer lock of ``directory`` (acquired on creation, released by :meth:`release`)."""

    def __init__(self, directory: Optional[str]):
        """Acquire the lock of ``directory``; None: a lock that holds nothing (what the ranks
        other than 0 hold: rank 0's lock covers them)."""
        self.path = os.path.join(directory, LOCK_FILE) if directory is not None else None
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        if directory is None:
            return
        with _guard(directory):
            fd = _open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fd = self._take_over_if_dead(directory, fd)
            except OSError as exc:
                os.close(fd)
                raise StorageError(f"cannot lock {self.path!r}: {exc.strerror or exc}") from exc
            self._fd = fd
            _write_record(self.path)
        _held.add(self)
        self._heartbeat = threading.Thread(target=self._beat, name="gockpt-lock-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _take_over_if_dead(self, directory: str, fd: int) -> int:
        """The lock is held: refuse, naming the holder -- unless the holder is dead (module
        docstring); then replace the lock file, lock the new one and return its descriptor."""
        record = _read_record(fd)
        dead = _why_dead(record, os.fstat(fd).st_mtime)
        os.close(fd)
        if dead is None:
            raise DirectoryInUseError(
                f"checkpoint directory {directory!r} is being written by another Checkpointer "
                f"({_describe(record)}); close it first (ck.close()) or give this run its own "
                "directory")
        try:
            os.unlink(self.path)  # whoever still holds the old file holds nothing now
            fd = _open_lock_file(self.path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise StorageError(f"cannot take over the lock {self.path!r} of a dead writer: "
                               f"{exc.strerror or exc}") from exc
        note = (f"gockpt: took over the lock of checkpoint directory {directory!r} from a dead "
                f"writer ({_describe(record)}: {dead})")
        log.warning(note)
        warnings.warn(note, stacklevel=4)
        return fd

    def _beat(self) -> None:
        """Refresh the heartbeat until released (what a writer on another host looks at)."""
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    @classmethod
    def shared(cls) -> "DirectoryLock":
        """What the ranks other than 0 hold: rank 0's lock covers them."""
        return cls(None)

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race with a new
        holder that has just opened it."""
        self._stop.set()
        beat = self._heartbeat
        if beat is not None and beat is not threading.current_thread():
            beat.join()  # a close() leaves no gockpt thread behind
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file releases the flock

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptor (the parent keeps the lock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _guard(directory: str):
    """Exclusive for the few system calls of an acquisition or a take-over."""
    path = os.path.join(directory, GUARD_FILE)
    fd = _open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for microseconds by whoever has it
        except OSError as exc:
            raise StorageError(f"cannot lock {path!r}: {exc.strerror or exc}") from exc
        yield
    finally:
        os.close(fd)


def _open_lock_file(path: str) -> int:
    # Held read-only: a descriptor open for writing would keep the file system from being
    # remounted read-only (the error must then come from the writes).
    try:
        return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise StorageError(f"cannot create the lock file {path!r}: "
                           f"{exc.strerror or exc}") from exc


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of /proc/pid/stat), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _write_record(path: str) -> None:
    """Who holds the lock, for the error of the next one who tries (best effort)."""
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
            "start": _process_start(os.getpid()), "argv": sys.argv[:4]}
    try:
        with open(path, "w") as f:
            f.write(json.dumps(info))
    except OSError:
        pass


def _read_record(fd: int) -> Optional[dict]:
    try:
        info = json.loads(os.pread(fd, RECORD_BYTES, 0).decode() or "null")
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def _why_dead(record: Optional[dict], heartbeat: float) -> Optional[str]:
    """Why the holder named by ``record`` is known to be dead, or None (alive, or unknown:
    an unreadable record is never taken over)."""
    try:
        pid, host = int(record["pid"]), str(record["host"])
    except (TypeError, KeyError, ValueError):
        return None
    if host != socket.gethostname():
        age = time.time() - heartbeat
        return f"no heartbeat for {age:.0f} s" if age > LEASE_S else None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} is not running"
    except PermissionError:
        pass  # alive, another user's
    start = record.get("start")
    if start is not None and _process_start(pid) not in (None, start):
        return f"pid {pid} is now another process"
    return None


def _describe(record: Optional[dict]) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["since"])))
        return f"pid {int(record['pid'])} on host {record['host']!s:.64}, since {since}"
    except (ValueError, KeyError, TypeError, OverflowError):
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
