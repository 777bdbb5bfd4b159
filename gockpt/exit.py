"""Checkpointers still open when the interpreter exits (an exception escaped the training
loop, no ``with``) are closed by an ``atexit`` hook, registered with the first one: before
the interpreter stops its daemon threads -- stopped there, a thread inside the C++ writer
would end the process with ``std::terminate`` -- and so that a checkpoint whose step was
reached is committed.

On several ranks a process leaving on an uncaught exception abandons instead
(:meth:`Checkpointer.abort`): committing would need the other ranks, which may be waiting for
this one in a training collective -- the job would hang instead of ending."""

from __future__ import annotations

import atexit
import logging
import sys
import weakref

log = logging.getLogger("gockpt")

# in the order they were built: on several ranks each close agrees with the other ranks on
# that Checkpointer's own group, in the same order on every rank
_open: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_registered = []
_first: list = []  # fn(failing) run before the Checkpointers are closed (integrations)


def close_at_exit(checkpointer) -> None:
    """Close ``checkpointer`` at exit unless :func:`forget_at_exit` is called first."""
    _open[id(checkpointer)] = checkpointer
    _register()


def first_at_exit(fn) -> None:
    """Run ``fn(failing)`` at exit before the open Checkpointers are closed (an integration
    that owns some of them: the DeepSpeed patch records a pending step boundary first);
    ``failing``: see :func:`leaving_on_exception`. Once per ``fn``."""
    if fn not in _first:
        _first.append(fn)
    _register()


def _register() -> None:
    if not _registered:
        _registered.append(atexit.register(_close_open))


def forget_at_exit(checkpointer) -> None:
    """``checkpointer`` was closed: nothing to do for it at exit."""
    if _open.get(id(checkpointer)) is checkpointer:
        del _open[id(checkpointer)]


def leaving_on_exception() -> bool:
    """Whether the interpreter is ending on an uncaught exception: it printed one, which sets
    ``sys.last_value`` (``sys.last_exc`` from Python 3.12). (An interactive session keeps the
    last error it printed: there a later exit counts as one on an exception too.)"""
    return getattr(sys, "last_exc", None) is not None \
        or getattr(sys, "last_value", None) is not None


def _close_open() -> None:
    failing = leaving_on_exception()
    for fn in _first:
        try:
            fn(failing)
        except Exception as exc:  # noqa: BLE001 -- the process is ending: say it, go on
            log.error("gockpt: at exit: %s", exc)
    for ck in list(_open.values()):
        try:
            ck.close_at_exit(failing)
        except Exception as exc:  # noqa: BLE001 -- the process is ending: say it, go on
            log.error("gockpt: closing the checkpointer of %s at exit: %s",
                      ck.config.directory, exc)
