"""What a run's processes record in ``metrics.jsonl`` beside the checkpoints, for the goodput
accounting (:mod:`gockpt.goodput`): each process's ``start`` (its Checkpointer built), each
load's start (``loading``) and end (``load``, with the step restored), its ``progress`` (a step
every ``PROGRESS_EVERY_S`` at most, so that the steps a killed process computed after its last
checkpoint are known), and its ``end`` (``close()``). Written by rank 0 only (one line per event:
the accounting follows one rank; the ranks of a job step together).

Every record carries ``time`` (wall clock, seconds since the epoch), ``pid`` and
``process_start`` (when the process started, from the kernel): a restart is a new process,
and the records of one process are one attempt of the job."""

from __future__ import annotations

import os
import time
from typing import Optional

from . import metrics

PROGRESS_EVERY_S = 0.5  # the resolution of the accounting's wasted progress

_identity: Optional[dict] = None


def process_start_time() -> float:
    """When this process started (wall clock): from ``/proc`` on Linux (the interpreter's
    own start, imports included, is restore time for the accounting; to the kernel's clock
    tick), else the first call."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # starttime (field 22 of stat: clock ticks after boot), against the uptime now
        return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def identity() -> dict:
    """``{"pid", "process_start"}`` of this process (its start read once; a forked child
    reads its own)."""
    global _identity
    if _identity is None or _identity["pid"] != os.getpid():
        _identity = {"pid": os.getpid(), "process_start": process_start_time()}
    return dict(_identity)


def record(directory: str, kind: str, quiet: bool = False, **fields) -> None:
    """Append ``{"record": kind, "time": now, pid, process_start, **fields}`` to
    ``directory/metrics.jsonl`` (a failure to write is logged -- at debug level with
    ``quiet``, for a directory only read from -- never raised)."""
    metrics.append_record(directory, {"record": kind, "time": time.time(), **identity(),
                                      **fields}, quiet=quiet)


class Progress:
    """Rank 0's progress records: at a step boundary, the step, when ``PROGRESS_EVERY_S`` has
    passed since the last (one comparison per boundary otherwise)."""

    def __init__(self, directory: str, enabled: bool):
        self.directory, self.enabled = directory, enabled
        self.step: Optional[int] = None
        self.at = 0.0  # wall clock of the last boundary
        self._next = time.monotonic() + PROGRESS_EVERY_S

    def boundary(self, step: int) -> None:
        self.step, self.at = step, time.time()
        if self.enabled and time.monotonic() >= self._next:
            self._next = time.monotonic() + PROGRESS_EVERY_S
            record(self.directory, "progress", step=step)

    def end(self) -> None:
        """The job's end (``close()``): the last step and when it was reached (what follows,
        until this record, is the last checkpoint's completion)."""
        if self.enabled:
            record(self.directory, "end", step=self.step, boundary_time=self.at or None)


__all__ = ["PROGRESS_EVERY_S", "process_start_time", "identity", "record", "Progress"]
