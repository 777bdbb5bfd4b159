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


# ------------------------------------------------------------------ shares

def test_a_share_reference_round_trips_and_resolves_to_its_elements():
    ref = TensorRef("model/w", 0, (4, 6), (), extent=(5, 17))
    assert TensorRef.from_json(ref.to_json()) == ref
    assert ref.to_json() == {"tensor": "model/w", "shape": [4, 6], "extent": [5, 17]}
    assert ref.stored_numel == 12 and ref.logical_shape([12]) == (4, 6)
    assert ref.check([12]) is None and "beyond" in ref.check([11])
    stored = torch.arange(12.0)
    assert torch.equal(ref.resolve({"model/w": stored}), stored)
    packed = TensorRef("pack/model/F32", 3, (4, 6), (), extent=(0, 2))
    assert torch.equal(packed.resolve({"pack/model/F32": stored}), stored[3:5])


@pytest.mark.parametrize("bad", [
    {"tensor": "model/w", "shape": [4, 6], "extent": [5, 25]},   # beyond the tensor
    {"tensor": "model/w", "shape": [4, 6], "extent": [7, 5]},    # backwards
    {"tensor": "model/w", "extent": [0, 5]},                     # no shape to be a part of
    {"tensor": "model/w", "shape": [4, 6], "extent": [0]},
    {"tensor": "model/w", "shape": [4, 6], "extent": [-1, 3]},
])
def test_malformed_share_references_are_refused(bad):
    assert TensorRef.from_json(bad) is None


def test_shares_must_cover_each_element_once():
    from gockpt.storage.shares import cover_problem
    assert cover_problem("w", [(4, 10, "p1"), (0, 4, "p0")], 10) is None
    assert "nowhere at elements 4..6" in cover_problem("w", [(0, 4, "p0"), (6, 10, "p1")], 10)
    assert "twice at elements 3..4" in cover_problem("w", [(0, 4, "p0"), (3, 10, "p1")], 10)
    assert "nowhere at elements 8..10" in cover_problem("w", [(0, 8, "p0")], 10)
    assert cover_problem("empty", [(0, 0, "p0"), (0, 0, "p1")], 0) is None
