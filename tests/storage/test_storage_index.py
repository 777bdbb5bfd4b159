"""gockpt.storage.index: the global index of a checkpoint written by several ranks -- every
part's slices merged by rank, and the check that they cover each tensor exactly once."""

from __future__ import annotations

import pytest

from gockpt.storage import manifest as manifest_mod
from gockpt.storage.index import index_problems, merge, slice_problem


def _rows(n_ranks: int, rows: int, cols: int):
    """FSDP2's Shard(0) of a (rows, cols) tensor over ``n_ranks``: ceil-sized chunks, the
    last ones short or empty."""
    chunk = -(-rows // n_ranks)
    out = []
    for r in range(n_ranks):
        lo = min(rows, r * chunk)
        hi = min(rows, lo + chunk)
        out.append({"w": [[rows, cols], "F32", ["slice", [lo, 0], [hi - lo, cols], None, []]]})
    return out


def test_merge_lists_every_rank_slice_in_rank_order():
    index = merge(_rows(4, 3, 5))
    assert index["w"]["shape"] == [3, 5] and index["w"]["dtype"] == "F32"
    assert index["w"]["slices"] == [[0, [0, 0], [1, 5]], [1, [1, 0], [1, 5]],
                                    [2, [2, 0], [1, 5]], [3, [3, 0], [0, 5]]]
    assert slice_problem("w", index["w"]) is None  # an empty slice on rank 3 is fine


def test_merge_records_who_wrote_each_share():
    index = merge([{"b": [[10], "F32", ["share", 0, 6, []]]},
                   {"b": [[10], "F32", ["share", 6, 10, []]]}])
    assert index["b"] == {"shape": [10], "dtype": "F32", "shares": [[0, 0, 6], [1, 6, 10]]}


@pytest.mark.parametrize("slices,why", [
    ([[0, [0, 0], [2, 4]]], "do not cover"),                       # a gap
    ([[0, [0, 0], [3, 4]], [1, [2, 0], [2, 4]]], "overlap"),         # an overlap
    ([[0, [0, 0], [4, 4]], [1, [4, 0], [1, 4]]], "exceeds"),         # beyond the shape
    ([[0, [0, 0], [4, 2]], [1, [0, 2], [4, 3]]], "exceeds"),
    ([[0, [0], [4]]], "malformed"),                                  # wrong rank
    ([[0, [0, -1], [4, 4]]], "malformed"),
])
def test_slices_that_do_not_cover_their_tensor_once_are_found(slices, why):
    problem = slice_problem("w", {"shape": [4, 4], "slices": slices})
    assert problem is not None and why in problem and "'w'" in problem


def test_replicated_blocks_count_once():
    whole = [0, 0], [4, 4]
    assert slice_problem("w", {"shape": [4, 4], "slices": [[0, *whole], [1, *whole]]}) is None
    cols = [[0, [0, 0], [4, 2]], [1, [0, 2], [4, 2]], [2, [0, 0], [4, 2]]]  # Shard(1) + a copy
    assert slice_problem("w", {"shape": [4, 4], "slices": cols}) is None


def test_replicas_that_split_a_block_into_shares_must_cover_it_once():
    """HSDP: ranks 0 and 2 hold the rows 0..1 alike, ranks 1 and 3 the rows 2..3; each pair
    split their block (8 elements) into shares, recorded as a fourth item [lo, hi]."""
    index = merge([{"w": [[4, 4], "F32", ["slice", [0, 0], [2, 4], [0, 5], [1, 0]]]},
                   {"w": [[4, 4], "F32", ["slice", [2, 0], [2, 4], None, []]]},
                   {"w": [[4, 4], "F32", ["slice", [0, 0], [2, 4], [5, 8], [1, 0]]]},
                   {}])  # rank 3 holds none of its block: rank 1 holds all of it
    assert index["w"]["slices"] == [[0, [0, 0], [2, 4], [0, 5]], [1, [2, 0], [2, 4]],
                                    [2, [0, 0], [2, 4], [5, 8]]]
    assert index["w"]["dims"] == [1, 0] and slice_problem("w", index["w"]) is None
    for bad, why in (([5, 7], "nowhere at elements 7..8"), ([4, 8], "twice at elements 4..5"),
                     ([5, 9], "malformed")):
        index["w"]["slices"][2][3] = bad
        problem = slice_problem("w", index["w"])
        assert problem is not None and why in problem, problem
    index["w"]["slices"][2] = [2, [0, 0], [2, 4]]  # a whole copy beside a share
    assert "twice" in slice_problem("w", index["w"])


def _part(rank: int, offsets, shape=(2, 4)):
    data = {"step": 1, "start_step": 1, "mode": "sync", "overlap_steps": 1, "rank": rank,
            "world_size": 2,
            "model": {"params": {"w": "model/w"}, "aliases": {}, "digests": {},
                      "slices": {"w": {"shape": [4, 4], "offsets": offsets}}},
            "small": {s: None for s in ("model", "optimizer", "scheduler", "rng",
                                        "extra_state")},
            "tensors": {"model/w": {"dtype": "F32", "shape": list(shape),
                                    "data_offsets": [0, 32]}}}
    return data


def test_a_part_that_disagrees_with_the_index_is_found():
    parts = [manifest_mod.parse("p0", _part(0, [0, 0])),
             manifest_mod.parse("p1", _part(1, [2, 0]))]
    index = merge([{"w": [[4, 4], "F32", ["slice", [0, 0], [2, 4], None, []]]},
                   {"w": [[4, 4], "F32", ["slice", [2, 0], [2, 4], None, []]]}])
    assert index_problems(index, parts) == []
    index["w"]["slices"][1][1] = [0, 0]  # rank 1 listed where rank 0 is (a copy): a gap
    assert "do not cover" in index_problems(index, parts)[0]
    index["w"]["slices"] = [[0, [0, 0], [2, 4]], [1, [2, 0], [2, 4]]]
    moved = [parts[0], manifest_mod.parse("p1", _part(1, [1, 0]))]
    assert "rank 1's part holds 'w' at [1, 0]" in index_problems(index, moved)[0]


@pytest.mark.parametrize("slices", [
    {"w": {"shape": [4, 4], "offsets": [3, 0]}},          # 2 rows at row 3: beyond 4
    {"w": {"shape": [4], "offsets": [0]}},                # another number of dimensions
    {"v": {"shape": [4], "offsets": [5]}},                # not stored here, beyond its shape
    {"v": {"shape": [4], "offsets": [0, 0]}},             # not stored here, malformed
    {"w": {"shape": [4, 4]}},                             # no offsets
    [1, 2]])
def test_a_part_manifest_with_slices_that_do_not_fit_is_refused(slices):
    data = _part(0, [0, 0])
    data["model"]["slices"] = slices
    with pytest.raises(Exception, match="slices"):
        manifest_mod.parse("p0", data)
