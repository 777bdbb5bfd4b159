"""The remote tier: every checkpoint committed in the local directory is copied to an object
store (``Config.remote``) by one background thread, behind training and never in its way.

One checkpoint's upload commits it in the store by the order of its objects
(:mod:`.upload`: the data files checked as they are read, the manifests, ``latest`` last).

A failed upload (the store unreachable, paused past the request timeout, refusing) is
retried with backoff (``Config.remote_retry_s``, doubled up to 5 minutes); training goes on,
the previous remote ``latest`` stays. A Checkpointer opening a directory queues the committed
checkpoints newer than the store's ``latest`` that the store lacks: a run killed mid-upload
is completed by the next one. A data object the store already holds with the same bytes
(same size, ETag equal to the local file's part MD5s) is not sent again, so a retry or a
resumed upload sends only what is missing; what a cut-off upload left of a checkpoint no
upload will complete (deleted locally since) is deleted from the store.

Uploads keep out of training's way: while training is inside a checkpoint's copies (the
time its hooks may block), no part is read (at most ``MAX_HOLD_S`` in all for one
checkpoint's copies, and not while someone waits for the uploads), and the uploads' threads
run at the lowest CPU priority. Where the uploads fall behind the checkpoints, a warning says
so once, and with ``keep_last`` the queued checkpoints the store's retention would delete at
once are not uploaded. Each upload appends a record ``{"record": "upload", ...}`` to
``metrics.jsonl`` (bytes sent, seconds, seconds paused, GB/s while not paused, the objects
reused, attempts)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..core import metrics
from ..core.errors import CorruptCheckpointError, GockptError, StorageError
from ..core.latch import Latch
from . import remote
from .commit import is_committed, list_checkpoints, read_latest, resolve
from .format import LATEST_FILE, MANIFEST_FILE, MANIFEST_MAX_BYTES, manifest_seal
from .manifest_file import read_small_file
from .upload import (delete_leftovers, drop_leftovers, find_leftovers, lower_priority,
                     store_key, upload_order)

log = logging.getLogger("gockpt")

MAX_RETRY_S = 300.0
MAX_HOLD_S = 10.0  # the longest the uploads pause for one checkpoint's copies, in all
PROGRESS_S = 30.0  # a close() waiting for the uploads says how far they are this often


@dataclass
class RemoteStatus:
    """How far the remote tier got (``Checkpointer.remote_status()``)."""

    url: str
    uploaded: list = field(default_factory=list)  # names, in upload order (this process)
    pending: list = field(default_factory=list)  # committed locally, not (yet) in the store
    uploading: Optional[str] = None
    latest: Optional[str] = None  # what the store's latest names, as this process set it
    error: Optional[str] = None  # the last failure, until an upload succeeds
    attempts: int = 0  # failed attempts since the last success
    superseded: list = field(default_factory=list)  # not uploaded: newer ones came (keep_last)

    def describe(self) -> str:
        parts = [f"remote tier {self.url}: "]
        parts.append(f"latest {self.latest}" if self.latest else "nothing uploaded yet")
        left = ([self.uploading] if self.uploading else []) + self.pending
        if left:
            parts.append(f"; not uploaded: {', '.join(left)}")
        if self.error:
            parts.append(f"; last error ({self.attempts} attempt(s)): {self.error}")
        return "".join(parts)


class Replicator:
    """Uploads the committed checkpoints of ``directory`` to ``url`` in the background."""

    def __init__(self, directory: str, url: str, *, keep_last: Optional[int] = None,
                 retry_s: float = 5.0,
                 yield_to: Optional[Callable[[], Optional[Latch]]] = None):
        self.directory = directory
        self.yield_to = yield_to  # what training is doing that uploads must not slow down
        self.url = url.rstrip("/")
        self.bucket, self.prefix = remote.bucket_of(self.url)  # (remote.register: the options)
        self.keep_last = keep_last
        self.retry_s = retry_s
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._status = RemoteStatus(self.url)
        self._stop = False
        self._waiters = 0  # threads in wait(): the uploads do not pause for training then
        self._failures = 0  # failed upload attempts so far (close() gives up on a new one)
        self._warned_behind = False
        self._held: Optional[Latch] = None  # the copies the uploads last paused for
        self._held_until = 0.0  # ... and until when at most
        self._paused_s = 0.0  # paused in this upload
        self._thread = threading.Thread(target=self._run, name="gockpt-remote", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training side

    def submit(self, name: str) -> None:
        """Queue the committed local checkpoint ``name``. Where the uploads fall behind the
        checkpoints, the queued ones the store's retention would delete right away are not
        uploaded at all (``keep_last``), and a warning says so once."""
        with self._cv:
            if name in self._queue or name == self._status.uploading:
                return
            self._queue.append(name)
            waiting = [n for n in self._queue
                       if n is not _RESUME and n != self._status.uploading]
            if self.keep_last is not None and len(waiting) > self.keep_last:
                for old in waiting[:len(waiting) - self.keep_last]:
                    self._queue.remove(old)  # (never the one being uploaded: _run pops it)
                    self._status.superseded.append(old)
            if len(waiting) > 2 and not self._warned_behind:
                self._warned_behind = True
                log.warning(
                    "gockpt: the uploads to %s fall behind the checkpoints (%d committed ones "
                    "wait): the store takes them more slowly than they come%s", self.url,
                    len(waiting), "; only the newest remote_keep_last are uploaded" if
                    self.keep_last is not None else "; checkpoint less often, set "
                    "remote_keep_last, or raise remote_options' concurrency")
            self._cv.notify_all()

    def resume(self) -> None:
        """Queue what an earlier run committed locally but did not upload (in the background)."""
        with self._cv:
            self._queue.appendleft(_RESUME)
            self._cv.notify_all()

    def status(self) -> RemoteStatus:
        with self._cv:
            s = self._status
            return RemoteStatus(s.url, list(s.uploaded), [n for n in self._queue if n is not _RESUME
                                                          and n != s.uploading],
                                s.uploading, s.latest, s.error, s.attempts, list(s.superseded))

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until nothing is left to upload (at most ``timeout`` seconds); whether so."""
        return self._wait(timeout, closing=False)

    def close(self, timeout: Optional[float] = None) -> RemoteStatus:
        """Stop once the uploads still queued or running are done: at most ``timeout`` seconds
        (``0``: at once; ``None``: until done, or until an upload fails meanwhile -- the store
        is down or refuses, and the job must still end), saying how far they are every
        ``PROGRESS_S``. What is left is said in a warning; the next Checkpointer of this
        directory uploads it."""
        if self._stop:
            return self.status()
        if timeout is None or timeout > 0:
            self._wait(timeout, closing=True)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        status = self.status()
        if status.pending or status.uploading:
            message = (f"gockpt: close() leaves checkpoints not uploaded: {status.describe()}. "
                       "The next Checkpointer of this directory uploads them (or "
                       "Config.remote_wait_s longer)")
            log.warning(message)
            warnings.warn(message, stacklevel=3)
        else:
            log.info("gockpt: %s", status.describe())
        return status

    def _wait(self, timeout: Optional[float], closing: bool) -> bool:
        """Wait until nothing is left to upload (at most ``timeout`` seconds); whether so.
        ``closing`` (close()): say how far the uploads are every ``PROGRESS_S`` and, without a
        timeout, give up when an upload fails meanwhile."""
        start = time.monotonic()
        with self._cv:
            self._waiters += 1  # (the uploads do not pause for training meanwhile)
            failures, next_line = self._failures, PROGRESS_S
            try:
                while self._queue or self._status.uploading:
                    waited = time.monotonic() - start
                    if timeout is not None and waited >= timeout:
                        return False
                    if closing and timeout is None and self._failures > failures:
                        return False  # the store fails: what is left stays for the next run
                    if closing and waited >= next_line:
                        log.warning("gockpt: close() waits for the uploads to %s: %s, %d "
                                    "more queued (%.0f s so far%s)", self.url,
                                    f"uploading {self._status.uploading}"
                                    if self._status.uploading else "looking for what is left",
                                    sum(n is not _RESUME and n != self._status.uploading
                                        for n in self._queue), waited,
                                    "" if timeout is None else f", at most {timeout:g} s")
                    while next_line <= waited:
                        next_line += PROGRESS_S
                    until = next_line if timeout is None else min(next_line, timeout)
                    self._cv.wait(until - waited)  # (woken by every upload's end)
                return True
            finally:
                self._waiters -= 1

    # ------------------------------------------------------------ background

    def _run(self) -> None:
        delay = self.retry_s
        lower_priority()
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                name = self._queue[0]
                self._status.uploading = None if name is _RESUME else name
            uploaded = False
            try:
                if name is _RESUME:
                    self._queue_missing()
                else:
                    uploaded = self._upload(name)
            except _Stopped:
                return  # close(): what is left is the next run's (nothing half-put is visible)
            except BaseException as exc:  # noqa: BLE001 -- the thread must not die
                with self._cv:
                    self._status.error = str(exc)
                    self._status.attempts += 1
                    self._failures += 1
                    self._status.uploading = None
                    if isinstance(exc, CorruptCheckpointError):  # never retried: not uploadable
                        self._queue.popleft()
                    self._cv.notify_all()
                log.warning("gockpt: upload of %s to %s failed (%s)%s", name if name is not _RESUME
                            else "the checkpoints left", self.url, exc,
                            "" if isinstance(exc, CorruptCheckpointError)
                            else f"; retrying in {delay:.3g} s")
                if not isinstance(exc, CorruptCheckpointError):
                    with self._cv:  # the backoff: cut short by close()
                        self._cv.wait_for(lambda: self._stop, delay)
                    delay = min(MAX_RETRY_S, delay * 2)
                continue
            delay = self.retry_s
            with self._cv:
                self._queue.popleft()
                self._status.uploading = None
                self._status.error, self._status.attempts = None, 0
                if uploaded:
                    self._status.uploaded.append(name)
                self._cv.notify_all()

    def _queue_missing(self) -> None:
        """Queue (in commit order) the local checkpoints newer than the store's ``latest``
        that the store does not hold as they are on disk, up to the local ``latest`` (one
        committed after it, by a job killed before naming it, the resumed job saves again)."""
        local = list_checkpoints(self.directory)
        with contextlib.suppress(ValueError):  # (an unreadable local latest: all of them)
            current = read_latest(self.directory)[0]
            local = local[:local.index(current) + 1] if current in local else local
        try:
            stored_latest, _ = read_latest(self.url)
        except ValueError:
            stored_latest = None
        newer = local[local.index(stored_latest) + 1:] if stored_latest in local else local
        if self.keep_last is not None:
            newer = newer[-self.keep_last:]
        missing = [n for n in newer if not self._in_store(n)]
        with self._cv:
            for n in reversed(missing):
                if n not in self._queue:
                    self._queue.insert(1, n)  # behind this entry, ahead of new ones
        if missing:
            log.info("gockpt: uploading %d checkpoint(s) an earlier run committed but did not "
                     "upload to %s: %s", len(missing), self.url, ", ".join(missing))
        # what an upload cut off (a killed run) left of a checkpoint no upload will complete:
        # not one of those just queued (their objects are reused), not committed in the store
        with self._cv:
            queued = set(n for n in self._queue if n is not _RESUME)
        found = find_leftovers(self.bucket, self.prefix, set(list_checkpoints(self.directory)))
        delete_leftovers(self.bucket, self.url, {n: keys for n, keys in found.items()
                                                 if n not in queued})

    def _in_store(self, name: str) -> bool:
        """Whether the store holds checkpoint ``name`` committed with the local manifest."""
        try:
            data = self._local_manifest(name)
        except (OSError, ValueError):
            return True  # nothing to upload from here
        return self._stored_manifest(name) == data

    def _local_manifest(self, name: str) -> bytes:
        """The bytes of checkpoint ``name``'s manifest in the local directory (OSError,
        ValueError: :func:`read_small_file`'s)."""
        local = os.path.join(self.directory, name, MANIFEST_FILE)
        return read_small_file(local, MANIFEST_MAX_BYTES, local)

    def _stored_manifest(self, name: str) -> Optional[bytes]:
        """The bytes of checkpoint ``name``'s manifest in the store: None where it has none,
        ``b""`` where its object is larger than any manifest can be (so not one)."""
        try:
            return self.bucket.get_small(self._key(name, MANIFEST_FILE), MANIFEST_MAX_BYTES)
        except FileNotFoundError:
            return None
        except ValueError:
            return b""

    def _key(self, *names: str) -> str:
        return store_key(self.prefix, *names)

    def _unpublish_replaced(self, name: str) -> None:
        """The store holds another checkpoint under ``name`` (the name was replaced locally:
        a step of a killed job saved again): its manifest is deleted before any object of
        the new one is put. Until the new manifest lands, the store then holds no checkpoint
        of that name (a load of its ``latest`` falls back to the newest committed one), never
        the old manifest over data objects being rewritten."""
        stored = self._stored_manifest(name)
        if stored is not None and stored != self._local_manifest(name):
            log.info("gockpt: %s in %s is another checkpoint than the local one of that "
                     "name: its manifest is deleted before the new one is uploaded", name,
                     self.url)
            self.bucket.delete(self._key(name, MANIFEST_FILE))

    def _upload(self, name: str) -> bool:
        """Upload checkpoint ``name``; False if it was deleted locally first (retention). A data
        object the store already holds with the same bytes (an upload cut off after it, by a
        failure or a killed process) is not sent again."""
        path = os.path.join(self.directory, name)
        if not is_committed(path):
            return self._given_up(name)
        lower_priority()  # (obstore's runtime threads start with the first request)
        t0 = time.perf_counter()
        self._paused_s = 0.0
        sent, reused = 0, []
        try:
            self._unpublish_replaced(name)
            for rel, check in upload_order(path):
                key, local = self._key(name, rel), os.path.join(path, rel)
                if check is not None and self.bucket.holds_file(key, local, check=check,
                                                                gate=self._gate):
                    reused.append(rel)
                    continue
                sent += self.bucket.put_file(key, local, check=check, gate=self._gate)
        except CorruptCheckpointError:
            drop_leftovers(self.bucket, self.url, self.prefix, name)  # never retried: what it put would stay for good
            raise
        except (OSError, StorageError):
            if not is_committed(path):  # deleted locally while it was read (retention)
                return self._given_up(name)
            raise
        seconds = time.perf_counter() - t0
        self._point_latest(name, path)
        self._apply_retention()
        with self._cv:
            attempts = self._status.attempts + 1
        busy = seconds - self._paused_s  # the rate of the upload itself, not of its pauses
        metrics.append_record(self.directory, {
            "record": "upload", "name": name, "url": self.url, "bytes": sent,
            "seconds": seconds, "paused_s": self._paused_s,
            "gbps": sent / busy / 1e9 if busy > 0 else None,
            "reused": reused, "attempts": attempts, "time": time.time()})
        log.info("gockpt: %s uploaded to %s (%.1f MB in %.2f s, %.2f GB/s%s)", name, self.url,
                 sent / 1e6, seconds, sent / max(busy, 1e-9) / 1e9,
                 f"; {len(reused)} object(s) already there" if reused else "")
        return True

    def _gate(self) -> None:
        """Before each part is read: while training is in a checkpoint's copies (its blocked
        time; ``yield_to`` gives the event that ends them), the upload pauses -- at most
        MAX_HOLD_S in all for one checkpoint's copies, so that long or back-to-back windows
        cannot starve it, and not while someone waits for the uploads (:meth:`wait`: they are
        wanted now). After close() it stops the upload (:class:`_Stopped`)."""
        busy = self.yield_to() if self.yield_to is not None else None
        if busy is not None and busy is not self._held:
            self._held, self._held_until = busy, time.monotonic() + MAX_HOLD_S
        while True:
            with self._cv:
                if self._stop:
                    raise _Stopped()
                if self._waiters:
                    return
            if busy is None or busy.is_set() or time.monotonic() >= self._held_until:
                return
            t0 = time.monotonic()
            busy.wait(0.05)  # (a waiter or close() is seen within 50 ms)
            self._paused_s += time.monotonic() - t0

    def _given_up(self, name: str) -> bool:
        """Checkpoint ``name`` was deleted locally before its upload completed: not uploaded."""
        log.info("gockpt: %s was deleted locally before it was uploaded", name)
        drop_leftovers(self.bucket, self.url, self.prefix, name)
        return False

    def _point_latest(self, name: str, path: str) -> None:
        """The store's ``latest`` -> ``name``, unless it names a checkpoint committed after
        ``name`` here."""
        try:
            current, _ = read_latest(self.url)
        except ValueError:
            current = None
        local = list_checkpoints(self.directory)
        if current in local and name in local and local.index(current) > local.index(name):
            return
        seal = manifest_seal(read_small_file(os.path.join(path, MANIFEST_FILE),
                                             MANIFEST_MAX_BYTES, MANIFEST_FILE))
        self.bucket.put_bytes(self._key(LATEST_FILE), f"{name}\n{seal}\n".encode())
        with self._cv:
            self._status.latest = name

    def _apply_retention(self) -> None:
        if self.keep_last is None:
            return
        names = list_checkpoints(self.url)
        try:
            keep = os.path.basename(resolve(self.url))
        except GockptError:
            keep = None
        for old in [n for n in names if n != keep][:max(0, len(names) - self.keep_last)]:
            # the manifest first: from then on it is no checkpoint, whatever is left of it
            self.bucket.delete(self._key(old, MANIFEST_FILE))
            self.bucket.delete_all(self._key(old))


class _Stopped(Exception):
    """close() was called: the upload in progress stops before its next part."""


_RESUME = object()  # queue entry: look for checkpoints an earlier run left unuploaded
