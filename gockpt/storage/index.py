"""The global index: where every slice of every parameter lives among a checkpoint's parts.

Each rank's part says, for each parameter that is a DTensor (FSDP2, tensor parallelism) or a
declared slice (``Config.global_slices``), its global shape and where its local block starts
in it (``model.slices`` of the part's manifest: ``{"shape": [...], "offsets": [...]}``; the
lengths are the stored shape -- a part that stores none of it, its replicas holding all of
it, lists it too: a load needs its place). Rank 0's top-level manifest carries the
``index``: per parameter (its ``state_dict`` name without wrappers), its global shape, dtype
and

- ``"slices": [[rank, offsets, lengths], ...]`` -- each part's block of the global tensor,
  offsets and lengths per dimension, as torch.distributed.checkpoint's chunk metadata; a
  fourth item ``[lo, hi]`` when the ranks holding that block alike (HSDP's replicas) split it
  into shares: the elements of the block (in its memory order, ``"dims"`` when not its own
  order) this part holds; or
- ``"shares": [[rank, lo, hi], ...]`` -- replicas that wrote one state in shares: who wrote
  which elements (in the parameter's memory order, ``"dims"`` when not its own order).

A parameter's aligned optimizer state lies in the same part as its slice, sliced alike.
Parameters that are each rank's own (plain tensors, not replicated) have no entry: they are
no slice of one global tensor. The index changes only when a plan does: the ranks gather it
then, not at every checkpoint (:meth:`gockpt.storage.ranks.Ranks.gather_if`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..core.plan import Plan
from .format import DTYPE_TO_CODE


def part_slices(plan: Plan) -> Dict[str, dict]:
    """``model.slices`` of this rank's part: each DTensor parameter's global shape and the
    offsets of its local shard."""
    return {s.name: {"shape": list(s.global_slice[0]), "offsets": list(s.global_slice[1])}
            for s in plan.slots if s.global_slice is not None}


def part_entries(plan: Plan) -> Dict[str, list]:
    """What this rank contributes to the index: name -> [global shape, dtype code, where]
    (``where``: ``["slice", offsets, lengths, extent or None, dims]`` or ``["share", lo, hi,
    dims]``); nothing for a replicated tensor of which it holds no element."""
    out = {}
    for s in plan.slots:
        code = DTYPE_TO_CODE[s.local.dtype]
        if s.global_slice is not None and s.here:
            shape, offsets = s.global_slice
            out[s.name] = [list(shape), code, ["slice", list(offsets), list(s.local.shape),
                                               None if s.whole else list(s.extent),
                                               list(s.dims)]]
        elif s.global_slice is None and plan.share[1] > 1 and s.held:
            out[s.name] = [list(s.local.shape), code, ["share", *s.extent, list(s.dims)]]
    return out


def merge(parts: List[Dict[str, list]]) -> Dict[str, dict]:
    """The index of a checkpoint from every rank's :func:`part_entries`, in rank order."""
    index: Dict[str, dict] = {}
    for rank, entries in enumerate(parts):
        for name, (shape, code, where) in entries.items():
            entry = index.setdefault(name, {"shape": shape, "dtype": code})
            if where[0] == "slice":
                extent, dims = where[3], where[4]
                entry.setdefault("slices", []).append(
                    [rank, where[1], where[2]] + ([extent] if extent else []))
            else:
                entry.setdefault("shares", []).append([rank, where[1], where[2]])
                extent, dims = True, where[3]
            if extent and dims:
                entry["dims"] = dims
    return index


def cover_problem(what: str, runs: List[Tuple[int, int, str]], numel: int) -> Optional[str]:
    """What is wrong with the element runs (lo, hi, holder) that parts hold of ``what``, a
    tensor of ``numel`` elements: None when they cover each element exactly once."""
    at = 0
    for lo, hi, part in sorted(r for r in runs if r[1] > r[0]):
        if lo < at:
            return (f"the parts hold {what} twice at elements {lo}..{min(hi, at)} ({part} and "
                    "another part)")
        if lo > at:
            break
        at = hi
    if at != numel:
        gap = min([lo for lo, hi, _ in runs if lo > at] + [numel])
        return (f"the parts hold {what} nowhere at elements {at}..{gap} (of {numel}): a "
                "replicated share is missing or damaged")
    return None


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
            isinstance(s, list) and len(s) in (3, 4) and type(s[0]) is int and _ints(s[1])
            and _ints(s[2]) and len(s[1]) == len(s[2]) == len(shape)
            and (len(s) == 3 or _ints(s[3]) and len(s[3]) == 2
                 and s[3][0] <= s[3][1] <= _numel(s[2])) for s in slices):
        return f"the index's slices of {name!r} are malformed"
    held: Dict[tuple, list] = {}  # block -> the rows of the ranks holding (some of) it
    for s in slices:
        if all(s[2]):
            held.setdefault((tuple(s[1]), tuple(s[2])), []).append(s)
    for (offsets, lengths), rows in held.items():
        if any(len(s) == 4 for s in rows):  # replicas that split the block into shares
            problem = cover_problem(f"the block of {name!r} at {list(offsets)}",
                                    [(*(s[3] if len(s) == 4 else (0, _numel(lengths))),
                                      f"rank {s[0]}") for s in rows], _numel(lengths))
            if problem:
                return problem
        # else ranks holding the same block (a Replicate placement) hold one copy each
    return boxes_problem(name, shape, sorted(held))


def boxes_problem(name: str, shape, boxes) -> Optional[str]:
    """Why the distinct blocks ``boxes`` ((offsets, lengths) per dimension) of tensor ``name``
    of ``shape`` do not cover it exactly once -- one beyond the shape, two overlapping, or
    elements none holds -- or None when they do."""
    boxes = [(o, n) for o, n in boxes if all(n)]  # an empty block holds nothing
    for offsets, lengths in boxes:
        if any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
            return f"a slice of {name!r} at {list(offsets)} of {list(lengths)} exceeds its " \
                   f"shape {list(shape)}"
    for i, (oa, na) in enumerate(boxes):
        for ob, nb in boxes[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, na, ob, nb)):
                return f"the slices of {name!r} at {list(oa)} and {list(ob)} overlap"
    # disjoint blocks inside the shape cover it iff their sizes add up
    if sum(_numel(n) for _, n in boxes) != _numel(shape):
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
            ref = m.model.params.get(name)  # None: its replicas hold all of it
            want = [] if ref is None else \
                [[rank, s["offsets"], list(m.logical_shape(ref))]
                 + ([list(ref.extent)] if ref.extent is not None else [])]
            listed = [x for x in index.get(name, {}).get("slices", []) if x[0] == rank]
            if listed != want:
                problems.append(f"rank {rank}'s part holds {name!r} at {s['offsets']}, which "
                                "the checkpoint's index does not list as its slice")
    return problems
