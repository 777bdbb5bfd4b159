"""Command-line tools whose reader goes away (``gockpt list DIR | head``): they stop quietly,
as Unix tools do, instead of ending with ``error: [Errno 32] Broken pipe`` (or Python's
"Exception ignored ... BrokenPipeError" when the write that fails is the flush at exit).
Imports nothing of gockpt's, so that ``gockpt-interval`` stays quick to start."""

from __future__ import annotations

import os
import sys
from typing import Callable


def quiet_on_broken_pipe(command: Callable[[], int]) -> int:
    """Run ``command`` (a tool's work; returns its exit status) and flush stdout, so that a
    reader gone away shows here. Then: no message, stdout pointed at /dev/null (what is still
    buffered is dropped without a second error at exit), status 0 -- the reader took what it
    wanted, as ``head`` does. A command catching OSError must let BrokenPipeError through."""
    try:
        status = command()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        except (OSError, ValueError, AttributeError):  # no real stdout (tests, embedding)
            pass
        return 0
