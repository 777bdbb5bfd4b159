"""gockpt.core.lists: list checks of the hooks' hot path."""

from __future__ import annotations

import torch

from gockpt.core.lists import has_none


class Loud:
    """Compares equal to everything, as a tensor's ``==`` would answer with a tensor."""

    def __eq__(self, other):
        raise AssertionError("has_none compared by value")

    __hash__ = object.__hash__


def test_has_none_finds_none_by_identity():
    assert not has_none([])
    assert has_none([None])
    assert has_none([torch.zeros(2), None, torch.ones(3)])
    assert not has_none([torch.zeros(2), torch.ones(3)])  # no tensor's __eq__ is called
    assert not has_none([Loud(), Loud()]) and has_none([Loud(), None])


def test_has_none_is_not_fooled_by_falsy_values():
    assert not has_none([0, "", [], False, torch.zeros(0)])
