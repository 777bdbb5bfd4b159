"""List helpers of the hooks' hot path: checks over thousands of tensors run as C-level
``map`` calls, not a Python generator step per tensor (which costs as much as the read)."""
from __future__ import annotations

import itertools
import operator


def has_none(items: list) -> bool:
    """Whether ``items`` holds None (by identity: ``None in items`` would call each tensor's
    ``__eq__``)."""
    return any(map(operator.is_, items, itertools.repeat(None)))
