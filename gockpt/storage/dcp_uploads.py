"""The uploads of :class:`~gockpt.storage.dcp_writer.GockptWriter`'s checkpoints to an object
store (``GockptWriter(..., remote="s3://bucket/prefix")``), as the remote tier uploads a
``Checkpointer``'s: the coordinator queues each checkpoint it commits with the run directory's
:class:`~gockpt.storage.replicate.Replicator` (data first, manifests last, the store's
``latest`` moved once every object is there and checked; what an earlier process committed but
did not upload goes first), in the background -- ``dcp.save`` does not wait for it.

A loop makes a writer per save or keeps one: the uploads of a run directory to a store are one
:class:`Replicator` per process, shared by its writers. The process's end (``atexit``) waits
for what they still owe, as a ``Checkpointer``'s ``close()`` does (``remote_wait_s``: ``None``
until uploaded or an upload fails, else at most that many seconds), saying how far they are
and, in a warning, what is left; :func:`wait_uploads` waits when the loop asks.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..core.errors import ConfigError
from ..core.remote_options import RemoteOptions, check_remote
from . import remote
from .replicate import RemoteStatus, Replicator

_lock = threading.Lock()
_uploads: Dict[Tuple[str, str], Tuple[Replicator, "Uploads"]] = {}
_exit_registered = False


@dataclass(frozen=True)
class Uploads:
    """Where a writer's checkpoints go, as ``GockptWriter``'s ``remote*`` arguments say (the
    ``Config`` fields of the same names)."""

    url: str
    options: RemoteOptions
    keep_last: Optional[int] = None
    wait_s: Optional[float] = None
    retry_s: float = 5.0

    @classmethod
    def of(cls, url, options=None, keep_last=None, wait_s=None) -> Optional["Uploads"]:
        """The uploads ``GockptWriter(remote=url, remote_options=..., remote_keep_last=...,
        remote_wait_s=...)`` asks for (None without ``url``); ConfigError naming a bad one."""
        if url is None:
            if (options, keep_last, wait_s) != (None, None, None):
                raise ConfigError("GockptWriter: remote_options, remote_keep_last and "
                                  "remote_wait_s need remote='s3://bucket/prefix'")
            return None
        try:
            url, options = check_remote(url, options, keep_last, cls.retry_s, wait_s)
        except ConfigError as exc:
            raise ConfigError(f"GockptWriter: {exc}") from None
        return cls(url, options, keep_last, wait_s)

    def submit(self, directory: str, name: str) -> None:
        """Queue checkpoint ``name``, just committed in ``directory`` (the coordinator)."""
        global _exit_registered
        directory = os.path.abspath(directory)  # (a writer given it relative, one absolute)
        with _lock:
            key = (directory, self.url)
            found = _uploads.get(key)
            if found is None or found[1] != self:
                if found is not None:  # other settings: the new uploads take over what is left
                    found[0].close(0)  # (at once: a save must not wait for the store)
                remote.register(self.url, self.options)
                replicator = Replicator(directory, self.url, keep_last=self.keep_last,
                                        retry_s=self.retry_s)
                replicator.resume()  # (what an earlier process left: uploaded first)
                found = _uploads[key] = (replicator, self)
            if not _exit_registered:
                atexit.register(close_uploads)
                _exit_registered = True
        found[0].submit(name)


def wait_uploads(timeout: Optional[float] = None) -> List[RemoteStatus]:
    """Wait until every checkpoint the ``GockptWriter``\\ s of this process committed with
    ``remote=`` is in its store (at most ``timeout`` seconds in all); the status of each run
    directory's uploads (``uploaded``, ``pending``, ``error``, ...)."""
    with _lock:
        replicators = [r for r, _ in _uploads.values()]
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for replicator in replicators:
        replicator.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out.append(replicator.status())
    return out


def close_uploads() -> List[RemoteStatus]:
    """The process's end: wait for what the uploads owe (each writer's ``remote_wait_s``),
    then stop them, saying what is left (the next writer of that directory, in any process,
    uploads it first)."""
    with _lock:
        found = list(_uploads.values())
        _uploads.clear()
    return [replicator.close(uploads.wait_s) for replicator, uploads in found]


def _forget() -> None:
    """A child forked while uploads run has their objects but not their threads (nor, maybe,
    a lock another thread held): it owes nothing."""
    global _lock
    _lock = threading.Lock()
    _uploads.clear()


os.register_at_fork(after_in_child=_forget)

__all__ = ["Uploads", "wait_uploads", "close_uploads"]
