"""What the ranks of one load agree on, by one gather on the default group each (every rank
calls them alike; in one process they answer alone)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .core.errors import CorruptCheckpointError, LoadError

# How a rank fared at a step of a load that every rank takes: agreed by :func:`agreed`.
LOADED, CORRUPT, FAILED = 0, 1, 2


def several() -> bool:
    """Whether this process is one of several ranks (a default group of more than one)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def everyone(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank."""
    if not several():
        return ok
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, bool(ok))
    return all(every)


def worst(level: int) -> int:
    """The largest of every rank's ``level`` (how badly each fared, in the caller's terms)."""
    if not several():
        return level
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, int(level))
    return max(every)


def common_prefix(keys: list) -> int:
    """How many of ``keys`` (strings) every rank holds alike, from the first on."""
    if not several():
        return len(keys)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, [str(k) for k in keys])
    n = min(map(len, every))
    return next((i for i in range(n) if len({e[i] for e in every}) > 1), n)


def outcome(failed: Optional[BaseException]) -> int:
    """How a rank fared, ``failed`` being its error (None: it went well)."""
    if failed is None:
        return LOADED
    return CORRUPT if isinstance(failed, CorruptCheckpointError) else FAILED


def agreed(failed: Optional[BaseException], what: str) -> Tuple[Optional[BaseException], int]:
    """(the error to raise on this rank or None, the worst outcome on any rank) of one step of
    a load that every rank takes, ``failed`` being this rank's error (None: it went well),
    agreed by one gather -- or none, when ``failed`` was agreed already (a step inside the
    one failed: every rank's error is marked with the outcome agreed, so that an enclosing
    step does not gather again, which the ranks that failed earlier would not join). A rank
    that went well gets an error saying that another rank's failed: a CorruptCheckpointError
    when the worst was a damaged file, so that every rank falls back alike."""
    if failed is not None and hasattr(failed, "gockpt_agreed"):
        return failed, failed.gockpt_agreed
    level_anywhere = worst(outcome(failed))
    if level_anywhere and failed is None:
        kind = CorruptCheckpointError if level_anywhere == CORRUPT else LoadError
        failed = kind(f"{what}: another rank could not load it (its error says why)")
    if failed is not None:
        failed.gockpt_agreed = level_anywhere
    return failed, level_anywhere
