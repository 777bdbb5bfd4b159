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


def fewest(n: int) -> int:
    """The least of ``n`` over the ranks."""
    if not several():
        return n
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, int(n))
    return min(every)
