"""The global index: where every slice of every parameter lives among a checkpoint's parts.

Each rank's part says, for each parameter that is a DTensor (FSDP2, tensor parallelism), its
global shape and where its local shard starts in it (``model.slices`` of the part's manifest:
``{"shape": [...], "offsets": [...]}``; the lengths are the stored shape). Rank 0's top-level
manifest carries the ``index``: per parameter (its ``state_dict`` name without wrappers), its
global shape, dtype and

- ``"slices": [[rank, offsets, lengths], ...]`` -- each part's block of the global tensor,
  offsets and lengths per dimension, as torch.distributed.checkpoint's chunk metadata; or
- ``"shares": [[rank, lo, hi], ...]`` -- replicas that wrote one state in shares: who wrote
  which elements (in the parameter's memory order, ``"dims"`` when not its own order).

A parameter's aligned optimizer state lies in the same part as its slice, sliced alike.
Parameters that are each rank's own (plain tensors, not replicated) have no entry: they are
no slice of one global tensor. The index changes only when a plan does: the ranks gather it
then, not at every checkpoint (:meth:`gockpt.storage.ranks.Ranks.gather_if`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ..core.plan import Plan
from .format import DTYPE_TO_CODE


def part_slices(plan: Plan) -> Dict[str, dict]:
    """``model.slices`` of this rank's part: each DTensor parameter's global shape and the
    offsets of its local shard."""
    return {s.name: {"shape": list(s.global_slice[0]), "offsets": list(s.global_slice[1])}
            for s in plan.slots if s.global_slice is not None}


def part_entries(plan: Plan) -> Dict[str, list]:
    """What this rank contributes to the index: name -> [global shape, dtype code, where]
    (``where``: ``["slice", offsets, lengths]`` or ``["share", lo, hi, dims]``)."""
    out = {}
    for s in plan.slots:
        code = DTYPE_TO_CODE[s.local.dtype]
        if s.global_slice is not None:
            shape, offsets = s.global_slice
            out[s.name] = [list(shape), code, ["slice", list(offsets), list(s.local.shape)]]
        elif plan.share[1] > 1 and s.held:
            out[s.name] = [list(s.local.shape), code, ["share", *s.extent, list(s.dims)]]
    return out


def merge(parts: List[Dict[str, list]]) -> Dict[str, dict]:
    """The index of a checkpoint from every rank's :func:`part_entries`, in rank order."""
    index: Dict[str, dict] = {}
    for rank, entries in enumerate(parts):
        for name, (shape, code, where) in entries.items():
            entry = index.setdefault(name, {"shape": shape, "dtype": code})
            if where[0] == "slice":
                entry.setdefault("slices", []).append([rank, where[1], where[2]])
            else:
                entry.setdefault("shares", []).append([rank, where[1], where[2]])
                if where[3]:
                    entry["dims"] = where[3]
    return index


def slice_problem(name: str, entry) -> Optional[str]:
    """Why the index ``entry`` of parameter ``name`` is malformed or does not cover its
    tensor exactly once (None: it does)."""
    if not isinstance(entry, dict) or not _ints(entry.get("shape")):
        return f"the index entry of {name!r} is malformed"
    shape = entry["shape"]
    slices = entry.get("slices")
    if slices is None:
        return None  # shares: their cover is checked from the parts (storage/shares.py)
    if not isinstance(slices, list) or not all(
            isinstance(s, list) and len(s) == 3 and _ints(s[1]) and _ints(s[2])
            and len(s[1]) == len(s[2]) == len(shape) for s in slices):
        return f"the index's slices of {name!r} are malformed"
    # ranks holding the same block (a Replicate placement) hold one copy of it
    blocks = sorted({(tuple(o), tuple(n)) for _, o, n in slices if all(n)})
    for offsets, lengths in blocks:
        if any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
            return f"a slice of {name!r} at {list(offsets)} of {list(lengths)} exceeds its " \
                   f"shape {shape}"
    for i, (oa, na) in enumerate(blocks):
        for ob, nb in blocks[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, na, ob, nb)):
                return f"the slices of {name!r} at {list(oa)} and {list(ob)} overlap"
    # disjoint blocks inside the shape cover it iff their sizes add up
    if sum(_numel(n) for _, n in blocks) != _numel(shape):
        return f"the slices of {name!r} do not cover all {_numel(shape)} of its elements"
    return None


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def index_problems(index, parts) -> List[str]:
    """What is wrong with the global ``index`` of a top-level manifest given its parts'
    manifests (``parts``: :class:`~gockpt.storage.schema.Manifest`, in rank order): a
    malformed entry, slices that do not cover their tensor exactly once, or a part whose
    own record of a slice says otherwise than the index."""
    if not isinstance(index, dict):
        return ["the manifest's 'index' is not an object"]
    problems = [p for name, entry in index.items() for p in [slice_problem(name, entry)] if p]
    if problems:
        return problems
    for rank, m in enumerate(parts):
        for name, s in m.model.slices.items():
            want = [rank, s["offsets"], list(m.logical_shape(m.model.params[name]))]
            listed = [x for x in index.get(name, {}).get("slices", []) if x[0] == rank]
            if listed != [want]:
                problems.append(f"rank {rank}'s part holds {name!r} at {s['offsets']}, which "
                                "the checkpoint's index does not list as its slice")
    return problems
