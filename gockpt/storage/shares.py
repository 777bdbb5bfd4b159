"""Reading a checkpoint whose replicas split their state into shares (``"shares": true`` in
its top-level manifest): every part holds, of each tensor the ranks hold alike, a contiguous
run of its elements in memory order (its reference's ``extent``, :mod:`.refs`) -- a
replicated tensor (DDP, ZeRO's module weights), or a block of a global tensor that several
ranks hold (HSDP's replicas of a shard) -- and each rank's own blocks whole (ZeRO
partitions, FSDP2 shards). Reading it means reading, of every part, what a rank holds, and
putting each tensor together, the pieces at one place (stored name and block offsets)
covering each element exactly once -- a gap or an overlap is a damaged checkpoint, never
zeros or a guess.
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
from .manifest_file import read_manifest
from .reader import read_tensors
from .index import cover_problem
from .refs import TensorRef, permuted
from .schema import Manifest, ModelSection, OptimizerSection, is_small_tensor


class _Whole:
    """One tensor being put together from the pieces the parts hold of it: a replicated
    tensor, or a slice of a global one held by one rank or split among its replicas."""

    def __init__(self, what: str, key: tuple, param: Optional[str], dtype: torch.dtype,
                 shape: Tuple[int, ...], dims: Tuple[int, ...]):
        self.what, self.key, self.param = what, key, param
        self.dtype, self.shape, self.dims = dtype, shape, dims
        self.runs: List[Tuple[int, int, str]] = []  # (first, end, part) of every piece
        self.flat: Optional[torch.Tensor] = None  # the elements in memory order
        self.only: Optional[torch.Tensor] = None  # a part's whole piece, kept as read

    def put(self, part: str, lo: int, piece: torch.Tensor) -> None:
        """A part's run of elements from ``lo``, flat in memory order: a whole piece as the
        first is kept as it is (nothing copied), the pieces of shares copied into place (as
        they are read: a part's buffer is freed before the next part is read)."""
        self.runs.append((lo, lo + piece.numel(), part))
        if len(self.runs) == 1 and piece.numel() == math.prod(self.shape):
            self.only = piece
            return
        if self.flat is None:
            self.flat = torch.empty(math.prod(self.shape), dtype=self.dtype)
            if self.only is not None:
                self.flat.copy_(self.only)
                self.only = None
        self.flat[lo:lo + piece.numel()].copy_(piece)

    def check(self, path: str) -> None:
        """CorruptCheckpointError unless the pieces cover every element exactly once."""
        problem = cover_problem(self.what, self.runs, math.prod(self.shape))
        if problem:
            raise CorruptCheckpointError(f"checkpoint {path!r}: {problem}")

    def stored(self) -> torch.Tensor:
        """The tensor as a whole-tensor reference with ``dims`` reads it (memory order)."""
        memory = permuted(self.shape, self.dims) if self.dims else self.shape
        return (self.only if self.only is not None else self.flat).view(memory)


def places(m: Manifest) -> Callable[[tuple], Tuple[Optional[str], Optional[tuple]]]:
    """For a :meth:`Manifest.stored_refs` key of part ``m``: (the parameter it belongs to,
    the offsets of that parameter's block in its global tensor -- ``model.slices``: a DTensor
    shard, a ZeRO partition -- or None when it is no slice). The parts' pieces of one stored
    name at one place are one tensor: a replicated one, or one block held by one rank or
    split among the replicas of that block (HSDP)."""
    slices = m.model.slices
    params = m.optimizer.params if m.optimizer is not None else {}

    def place(key: tuple) -> Tuple[Optional[str], Optional[tuple]]:
        param = key[1] if key[0] is None else params.get(key[0])
        s = slices.get(param)
        return param, (tuple(s["offsets"]) if s is not None else None)
    return place


def own_state(m: Manifest) -> Callable[[tuple], bool]:
    """Whether a :meth:`Manifest.stored_refs` key of part ``m`` is state of a parameter that
    is its rank's slice of a global tensor (a DTensor shard, a ZeRO partition), not a
    replicated tensor every rank holds."""
    place = places(m)
    return lambda key: place(key)[1] is not None


def coverage_problems(parts: List[Manifest]) -> List[str]:
    """From the manifests of a checkpoint's parts alone (nothing read): every tensor whose
    pieces do not cover it exactly once -- a replicated one's shares, or a block of a global
    tensor held by one part or split among its replicas -- or whose parts disagree on its
    shape (where each block lies in its global tensor is checked by the index: :mod:`.index`)."""
    runs: Dict[tuple, list] = {}
    shapes: Dict[tuple, Tuple[int, ...]] = {}
    problems = []
    for m in parts:
        place = places(m)
        for name, what, ref, key in m.stored_refs():
            at = (name, place(key)[1])
            shape = tuple(m.logical_shape(ref))
            if shapes.setdefault(at, shape) != shape:
                problems.append(f"part {m.rank} stores {what} as {list(shape)}, another "
                                f"part as {list(shapes[at])}")
            lo, hi = ref.extent if ref.extent is not None else (0, math.prod(shape))
            runs.setdefault(at, []).append((lo, hi, f"part {m.rank}"))
    for (name, offsets), taken in runs.items():
        what = name if offsets is None else f"{name} (the block at {list(offsets)})"
        problem = cover_problem(what, taken, math.prod(shapes[(name, offsets)]))
        if problem:
            problems.append(problem)
    return problems


def gather(path: str, own: Manifest, *, verify: bool,
           check: Callable[[str, Manifest, dict], None]) -> Optional[Tuple[Manifest, dict]]:
    """A checkpoint at ``path`` (its top-level directory) written in shares, put together for
    the rank of part ``own`` (whose small state that rank restores): ``own`` with every
    parameter and aligned optimizer state tensor of that rank referenced whole -- the
    replicated ones, and its blocks of global tensors, split among its replicas or not --
    and the tensors it names (stored name -> tensor: its small state too). None for a
    checkpoint not written in shares.

    Of every part only what this rank holds is read (checksums unless ``verify=False``);
    each part is handed to ``check(part path, its manifest, its tensors)`` as read -- the
    digests of the live state at F were taken per share -- before its pieces are put in
    place. CorruptCheckpointError naming the tensor when the parts do not cover it exactly
    once, or disagree on its shape or dtype."""
    together = read_together(path, verify=verify, check=check, rank=own.rank)
    return None if together is None else together[own.rank]


def read_together(path: str, *, verify: bool, check: Callable[[str, Manifest, dict], None],
                  rank: Optional[int] = None) -> Optional[Dict[int, Tuple[Manifest, dict]]]:
    """:func:`gather` for the rank ``rank`` (None: every rank, each part read once): rank ->
    (its part's manifest with its tensors referenced whole, the tensors it names -- what it
    holds alike with other ranks shared between their views -- and its small state read
    from its part). None for a checkpoint not written in shares."""
    data = read_manifest(path)
    if data.get("shares") is not True:
        return None
    names = parts_of(path, data)
    manifests: List[Manifest] = []
    for r, part in enumerate(names):
        ppath = os.path.join(path, part)
        m = parse(ppath, read_manifest(ppath))
        if (m.step, m.rank, m.world_size) != (data.get("step"), r, len(names)):
            raise CorruptCheckpointError(
                f"checkpoint {path!r}: {part} is rank {m.rank} of {m.world_size} at step "
                f"{m.step}, listed as rank {r} of {len(names)} at step {data.get('step')}: "
                "its share belongs to another checkpoint")
        manifests.append(m)
    ranks = range(len(names)) if rank is None else [rank]
    # each rank's place of each parameter: what it needs of every part
    wants = {r: {p: tuple(s["offsets"]) for p, s in manifests[r].model.slices.items()}
             for r in ranks}
    wholes: Dict[tuple, _Whole] = {}
    smalls: Dict[int, dict] = {}
    for r, (part, m) in enumerate(zip(names, manifests)):
        ppath = os.path.join(path, part)
        place = places(m)
        refs = [(name, what, ref, key, *place(key)) for name, what, ref, key in m.stored_refs()]
        refs = [x for x in refs if any(w.get(x[4]) == x[5] for w in wants.values())]
        small = [n for n in m.tensors if is_small_tensor(n)] if r in wants else []
        tensors = read_tensors(ppath, m, sorted({x[2].tensor for x in refs} | set(small)),
                               verify=verify)
        if verify:
            check(ppath, m, tensors)  # (the digests of the tensors read)
        smalls[r] = {n: tensors[n] for n in small}
        for name, what, ref, key, param, offsets in refs:
            dtype = CODE_TO_DTYPE[m.tensors[ref.tensor]["dtype"]]
            shape = tuple(m.logical_shape(ref))
            whole = wholes.get((name, offsets))
            if whole is None:
                whole = wholes[(name, offsets)] = _Whole(what, key, param, dtype, shape,
                                                         ref.dims)
            elif (whole.dtype, whole.shape, whole.dims) != (dtype, shape, ref.dims):
                raise CorruptCheckpointError(
                    f"checkpoint {path!r}: {part} stores {what} as {dtype} {list(shape)}, "
                    f"another part as {whole.dtype} {list(whole.shape)} (or in another "
                    "memory order)")
            piece = ref.resolve(tensors)
            if ref.extent is None:  # stored whole here: flat in memory order
                piece = piece.permute(ref.dims) if ref.dims else piece
                whole.put(part, 0, piece.contiguous().view(-1))
            else:
                whole.put(part, ref.extent[0], piece.reshape(-1))
        del tensors
    stored: Dict[tuple, torch.Tensor] = {}
    for at, whole in wholes.items():
        whole.check(path)
        stored[at] = whole.stored()
    out = {}
    for r in ranks:
        m = manifests[r]
        params: Dict[str, TensorRef] = {}
        aligned: Dict[int, Dict[str, TensorRef]] = {}
        owners = dict(m.optimizer.params) if m.optimizer is not None else {}
        tensors = dict(smalls[r])
        table = {n: m.tensors[n] for n in tensors}
        for (name, offsets), whole in wholes.items():
            if wants[r].get(whole.param) != offsets:
                continue  # another rank's block
            ref = TensorRef(name, dims=whole.dims)
            if whole.key[0] is None:
                params[whole.key[1]] = ref
            else:
                aligned.setdefault(whole.key[0], {})[whole.key[1]] = ref
                if whole.param is not None:
                    owners[whole.key[0]] = whole.param
            tensors[name] = stored[(name, offsets)]
            table[name] = {"dtype": DTYPE_TO_CODE[whole.dtype],
                           "shape": list(tensors[name].shape)}
        optimizer = None if m.optimizer is None else \
            OptimizerSection(m.optimizer.cls, aligned, params=owners)
        model = ModelSection(params, dict(m.model.aliases), slices=dict(m.model.slices))
        out[r] = (replace(m, model=model, optimizer=optimizer, tensors=table), tensors)
    return out
