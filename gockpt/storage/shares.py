"""Reading a checkpoint whose replicas split one state into shares (``"shares": true`` in its
top-level manifest): every part holds, of each tensor, a contiguous run of its elements in
memory order (its reference's ``extent``, :mod:`.refs`). Reading it means reading every part
and putting each tensor together, with the parts covering each element exactly once -- a gap
or an overlap is a damaged checkpoint, never zeros or a guess.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.errors import CorruptCheckpointError
from .format import CODE_TO_DTYPE, DTYPE_TO_CODE
from .manifest import parse, parts_of
from .reader import read_manifest, read_tensors
from .refs import TensorRef, permuted
from .schema import Manifest, ModelSection, OptimizerSection, is_small_tensor


class _Whole:
    """One tensor being put together: its flat buffer in memory order and the element runs
    the parts gave."""

    def __init__(self, what: str, key: tuple, dtype: torch.dtype, shape: Tuple[int, ...],
                 dims: Tuple[int, ...]):
        self.what, self.key, self.dtype, self.shape, self.dims = what, key, dtype, shape, dims
        self.flat = torch.empty(math.prod(shape), dtype=dtype)
        self.runs: List[Tuple[int, int, str]] = []

    def put(self, part: str, lo: int, piece: torch.Tensor) -> None:
        self.flat[lo:lo + piece.numel()].copy_(piece.reshape(-1))
        self.runs.append((lo, lo + piece.numel(), part))

    def check(self, path: str) -> None:
        """CorruptCheckpointError unless the runs cover every element exactly once."""
        problem = cover_problem(self.what, self.runs, self.flat.numel())
        if problem:
            raise CorruptCheckpointError(f"checkpoint {path!r}: {problem}")

    def stored(self) -> torch.Tensor:
        """The tensor as a whole-tensor reference with ``dims`` reads it (memory order)."""
        return self.flat.view(permuted(self.shape, self.dims) if self.dims else self.shape)


def cover_problem(what: str, runs: List[Tuple[int, int, str]], numel: int) -> Optional[str]:
    """What is wrong with the element runs (lo, hi, part) the parts hold of ``what``, a tensor
    of ``numel`` elements: None when they cover each element exactly once."""
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


def own_state(m: Manifest) -> Callable[[tuple], bool]:
    """Whether a :meth:`Manifest.stored_refs` key of part ``m`` is this part's own state -- a
    parameter that is its rank's slice of a global tensor (``model.slices``: a DTensor shard,
    a ZeRO partition) or such a parameter's optimizer state -- which no share of another part
    completes: it is never put together, and only its rank reads it."""
    params = set(m.model.slices)
    states = {i for i, n in (m.optimizer.params if m.optimizer is not None else {}).items()
              if n in params}
    return lambda key: key[1] in params if key[0] is None else key[0] in states


def coverage_problems(parts: List[Manifest]) -> List[str]:
    """From the manifests of a checkpoint's parts alone (nothing read): every replicated
    tensor whose shares do not cover it exactly once, or whose parts disagree on its shape
    (each part's own state is checked by the global index: :mod:`.index`)."""
    runs: Dict[str, list] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    problems = []
    for m in parts:
        own = own_state(m)
        for name, what, ref, key in m.stored_refs():
            if own(key):
                continue
            shape = tuple(m.logical_shape(ref))
            if shapes.setdefault(name, shape) != shape:
                problems.append(f"part {m.rank} stores {what} as {list(shape)}, another "
                                f"part as {list(shapes[name])}")
            lo, hi = ref.extent if ref.extent is not None else (0, math.prod(shape))
            runs.setdefault(name, []).append((lo, hi, f"part {m.rank}"))
    for name, taken in runs.items():
        problem = cover_problem(name, taken, math.prod(shapes[name]))
        if problem:
            problems.append(problem)
    return problems


def gather(path: str, own: Manifest, *, verify: bool,
           check: Callable[[str, Manifest, dict], None]) -> Optional[Tuple[Manifest, dict]]:
    """A checkpoint at ``path`` (its top-level directory) written in shares, put together for
    the rank of part ``own`` (whose small state that rank restores): ``own`` with every
    replicated parameter and aligned optimizer state tensor referenced whole, its own state
    (:func:`own_state`) as it stored it, and the tensors it names (stored name -> tensor: its
    small state too). None for a checkpoint not written in shares.

    Every part's shares are read (checksums unless ``verify=False``), and only ``own``'s own
    state; each part is handed to ``check(part path, its manifest, its tensors)`` as read --
    the digests of the live state at F were taken per share -- before its pieces are put in
    place. CorruptCheckpointError naming the tensor when the parts do not cover it exactly
    once, or disagree on its shape or dtype."""
    together = read_together(path, verify=verify, check=check, rank=own.rank)
    return None if together is None else together[own.rank]


def read_together(path: str, *, verify: bool, check: Callable[[str, Manifest, dict], None],
                  rank: Optional[int] = None) -> Optional[Dict[int, Tuple[Manifest, dict]]]:
    """:func:`gather` for the rank ``rank`` (None: every rank, each part read once): rank ->
    (its part's manifest with the replicated tensors referenced whole, the tensors it names
    -- the replicated ones shared by every rank, its own state and its small state read from
    its part). None for a checkpoint not written in shares."""
    data = read_manifest(path)
    if data.get("shares") is not True:
        return None
    wholes: Dict[str, _Whole] = {}
    manifests: Dict[int, Manifest] = {}
    owned: Dict[int, Tuple[list, dict]] = {}  # rank -> (its own refs, the tensors they read)
    names = parts_of(path, data)
    for r, part in enumerate(names):
        ppath = os.path.join(path, part)
        m = parse(ppath, read_manifest(ppath))
        if (m.step, m.rank, m.world_size) != (data.get("step"), r, len(names)):
            raise CorruptCheckpointError(
                f"checkpoint {path!r}: {part} is rank {m.rank} of {m.world_size} at step "
                f"{m.step}, listed as rank {r} of {len(names)} at step {data.get('step')}: "
                "its share belongs to another checkpoint")
        is_own = own_state(m)
        mine = rank is None or r == rank
        refs = [x for x in m.stored_refs() if mine or not is_own(x[3])]
        small = [n for n in m.tensors if is_small_tensor(n)] if mine else []
        tensors = read_tensors(ppath, m, sorted({x[2].tensor for x in refs} | set(small)),
                               verify=verify)
        if verify:
            check(ppath, m, tensors)  # (the digests of the tensors read)
        if mine:  # its own state and its small state: only its rank's view holds them
            manifests[r] = m
            owned[r] = ([x for x in refs if is_own(x[3])], {n: tensors[n] for n in small})
        for name, what, ref, key in refs:
            if is_own(key):
                owned[r][1][ref.tensor] = tensors[ref.tensor]
                continue
            dtype = CODE_TO_DTYPE[m.tensors[ref.tensor]["dtype"]]
            shape = tuple(m.logical_shape(ref))
            whole = wholes.get(name)
            if whole is None:
                whole = wholes[name] = _Whole(what, key, dtype, shape, ref.dims)
            elif (whole.dtype, whole.shape, whole.dims) != (dtype, shape, ref.dims):
                raise CorruptCheckpointError(
                    f"checkpoint {path!r}: {part} stores {what} as {dtype} {list(shape)}, "
                    f"another part as {whole.dtype} {list(whole.shape)} (or in another "
                    "memory order)")
            piece = ref.resolve(tensors)
            if ref.extent is None:  # stored whole here (e.g. an empty tensor)
                piece = piece.permute(ref.dims) if ref.dims else piece
                whole.put(part, 0, piece.contiguous())
            else:
                whole.put(part, ref.extent[0], piece)
        del tensors
    stored: Dict[str, torch.Tensor] = {}
    params: Dict[str, TensorRef] = {}
    aligned: Dict[int, Dict[str, TensorRef]] = {}
    table = {}
    for name, whole in wholes.items():
        whole.check(path)
        stored[name] = whole.stored()
        whole_ref = TensorRef(name, dims=whole.dims)
        if whole.key[0] is None:
            params[whole.key[1]] = whole_ref
        else:
            aligned.setdefault(whole.key[0], {})[whole.key[1]] = whole_ref
        table[name] = {"dtype": DTYPE_TO_CODE[whole.dtype], "shape": list(stored[name].shape)}
    out = {}
    for r, m in manifests.items():
        refs, tensors = owned[r]
        own_params, own_aligned = dict(params), {i: dict(by) for i, by in aligned.items()}
        for _, _, ref, (idx, key) in refs:
            if idx is None:
                own_params[key] = ref
            else:
                own_aligned.setdefault(idx, {})[key] = ref
        own_table = dict(table)
        own_table.update({n: m.tensors[n] for n in tensors})  # its own and its small state
        optimizer = None if m.optimizer is None else \
            OptimizerSection(m.optimizer.cls, own_aligned, params=dict(m.optimizer.params))
        model = ModelSection(own_params, dict(m.model.aliases), slices=dict(m.model.slices))
        out[r] = (replace(m, model=model, optimizer=optimizer, tensors=own_table),
                  {**stored, **tensors})
    return out
