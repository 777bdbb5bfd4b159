"""The files Lightning's ``ModelCheckpoint`` names when its saves are gockpt's checkpoints
(:class:`gockpt.integrations.lightning.GockptCallback`): each a small JSON pointer to the
gockpt checkpoint of its step, written once that checkpoint is durable, and read back when a
``ckpt_path`` names it."""

from __future__ import annotations

import json
import os
import queue
import threading
import warnings
from typing import List, Optional

from ..core.errors import ConfigError

POINTER_KEY = "gockpt_checkpoint"
"""The key of the JSON file ``ModelCheckpoint`` names: the gockpt checkpoint it stands for."""


class Pointers:
    """The files ``ModelCheckpoint`` named, each written (rank 0: ``write``) as a pointer to
    its gockpt checkpoint once that is durable, by a thread of their own (a crash before
    leaves the file as it was: ``last.ckpt`` names the previous durable checkpoint); a file
    removed meanwhile (``remove_checkpoint``) is not written."""

    def __init__(self, write: bool):
        self.write = write
        self._queue: queue.Queue = queue.Queue()
        self._removed: set = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="gockpt-lightning-files",
                                        daemon=True)
        self._thread.start()

    def add(self, handle, files: List[str]) -> None:
        with self._lock:
            self._removed.difference_update(files)
        self._queue.put((handle, files))

    def removed(self, path) -> None:
        with self._lock:
            self._removed.add(os.fspath(path))

    def flush(self) -> None:
        """Block until the files queued so far are written (or given up)."""
        self._queue.join()

    def close(self, wait: bool = True) -> None:
        if wait:
            self.flush()
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                handle, files = item
                handle.progress.durable.wait()
                if handle.error is not None:
                    warnings.warn(f"gockpt: {', '.join(files)} not written: the checkpoint of "
                                  f"step {handle.final_step} failed ({handle.error})",
                                  RuntimeWarning)
                elif self.write:
                    with self._lock:
                        for path in files:
                            if path not in self._removed:
                                write_pointer(path, handle.path)
            finally:
                self._queue.task_done()


def write_pointer(path: str, checkpoint: str) -> None:
    """``path`` (atomically): a pointer to the gockpt checkpoint directory ``checkpoint``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({POINTER_KEY: os.path.abspath(checkpoint)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def pointed(path: str) -> Optional[str]:
    """The gockpt checkpoint a file written by :func:`write_pointer` names (None: another
    file); ConfigError when that checkpoint is gone."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        found = json.loads(head)[POINTER_KEY] if head[:1] == b"{" else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(found, str):
        return None
    if not os.path.isdir(found):
        raise ConfigError(f"{path} names the gockpt checkpoint {found}, which is not there "
                          "(deleted by keep_last, or the run directory moved)")
    return found
