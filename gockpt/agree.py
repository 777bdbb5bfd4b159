"""What the ranks of one load agree on, by one gather on the default group each (every rank
calls them alike; in one process they answer alone)."""

from __future__ import annotations

import torch


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
