"""gockpt.storage.refs: where a logical tensor lives among the stored ones (packs, layouts)."""

from __future__ import annotations

import pytest
import torch

from gockpt.storage.refs import TensorRef, inverse, permuted


@pytest.mark.parametrize("ref", [
    TensorRef("model/w"), TensorRef("pack/model/F32", 7, (2, 3)),
    TensorRef("model/conv", dims=(0, 2, 3, 1)), TensorRef("pack/x", 0, (3, 2), (1, 0))])
def test_json_round_trip(ref):
    assert TensorRef.from_json(ref.to_json()) == ref
    assert isinstance(ref.to_json(), str) == (ref == TensorRef(ref.tensor))


@pytest.mark.parametrize("bad", [
    5, None, {"tensor": 3}, {"tensor": "x", "offset": -1}, {"tensor": "x", "dims": [0, 0]},
    {"tensor": "x", "shape": [2], "dims": [1, 0]}, {"tensor": "x", "shape": "2"},
    {"tensor": "x", "more": 1}, {"tensor": "x", "offset": True}])
def test_malformed_references_are_refused(bad):
    assert TensorRef.from_json(bad) is None


def test_check_against_the_stored_shape():
    assert TensorRef("p", 4, (2, 3)).check([10]) is None
    assert "beyond" in TensorRef("p", 5, (2, 3)).check([10])
    assert "without a shape" in TensorRef("p", 1).check([10])
    assert "do not fit" in TensorRef("w", dims=(1, 0)).check([2, 3, 4])


def test_logical_shape_and_resolve_permute_back():
    stored = torch.arange(24.0).view(2, 3, 4)  # a (2, 4, 3)-shaped tensor in memory order
    ref = TensorRef("w", dims=(0, 2, 1))
    assert ref.logical_shape([2, 3, 4]) == (2, 4, 3)
    t = ref.resolve({"w": stored})
    assert t.shape == (2, 4, 3) and torch.equal(t.permute(0, 2, 1), stored)
    assert permuted((5, 6, 7), (2, 0, 1)) == (7, 5, 6) and inverse((2, 0, 1)) == (1, 2, 0)
