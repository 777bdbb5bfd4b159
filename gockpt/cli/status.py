"""How a command of the ``gockpt`` tool ends: the errors that become its exit statuses and the
one-line message it prints. Imports nothing that imports torch, so that the tool's entry point
(``gockpt.cli``, the package every command and ``gockpt-interval`` import first) starts
quickly."""

from __future__ import annotations

PROG = "gockpt"


class UsageError(Exception):
    """Bad arguments, a path that does not exist or holds no checkpoint: exit status 2."""


class BadCheckpoint(Exception):
    """The checkpoint exists but is damaged or not what gockpt wrote: exit status 1."""


def one_line(exc) -> str:
    """An exception (or message) as one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
