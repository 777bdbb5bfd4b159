"""List helpers of the hooks' hot path: checks over thousands of tensors run as C-level
``map`` calls, not a Python generator step per tensor (which costs as much as the read)."""
from __future__ import annotations

import itertools
import operator


def has_none(items: list) -> bool:
    """Whether ``items`` holds None (by identity: ``None in items`` would call each tensor's
    ``__eq__``)."""
    return any(map(operator.is_, items, itertools.repeat(None)))


class PlainInts(list):
    """A list of ints (exactly ``int``, each within what JSON holds as it is: below 2**53 in
    magnitude) made by gockpt itself and never changed once made, such as the state indices of
    a plan: the small state's encoder (:mod:`gockpt.storage.tree`) stores it without checking
    every item again (a pass over thousands of cold ints at every checkpoint's F)."""

    __slots__ = ()
