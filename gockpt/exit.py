"""Checkpointers still open when the interpreter exits (an exception escaped the training
loop, no ``with``) are closed by an ``atexit`` hook, registered with the first one: before
the interpreter stops its daemon threads -- stopped there, a thread inside the C++ writer
would end the process with ``std::terminate`` -- and so that a checkpoint whose step was
reached is committed."""

from __future__ import annotations

import atexit
import logging
import weakref

log = logging.getLogger("gockpt")

_open: "weakref.WeakSet" = weakref.WeakSet()
_registered = []


def close_at_exit(checkpointer) -> None:
    """Close ``checkpointer`` at exit unless :func:`forget_at_exit` is called first."""
    _open.add(checkpointer)
    if not _registered:
        _registered.append(atexit.register(_close_open))


def forget_at_exit(checkpointer) -> None:
    """``checkpointer`` was closed: nothing to do for it at exit."""
    _open.discard(checkpointer)


def _close_open() -> None:
    for ck in list(_open):
        try:
            ck.close()
        except Exception as exc:  # noqa: BLE001 -- the process is ending: say it, go on
            log.error("gockpt: closing the checkpointer of %s at exit: %s",
                      ck.config.directory, exc)
