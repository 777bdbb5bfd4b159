"""A gockpt checkpoint as torch.distributed.checkpoint (DCP) reads one: :class:`GockptReader`,
a ``StorageReader`` whose metadata is built from gockpt's JSON manifests and global index
(never from a pickle) and whose reads verify gockpt's checksums. ``dcp.load(state_dict,
storage_reader=GockptReader(path))`` then loads a checkpoint written by N ranks into any
sharding DCP plans -- plain tensors, DTensors on M ranks -- with DCP's own planner.

What a checkpoint offers, by DCP's flattened names (``dcp.load`` flattens nested dicts with
dots):

- the model's parameters and buffers: ``<name>`` (torchtitan's flat model state) and
  ``model.<name>`` (``{"model": model_sd, ...}``), tied names included;
- the optimizer's per-element state: ``optimizer.state.<param name>.<key>`` (what
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives, flattened or not), with
  its other tensor state (``step``) at the same names; its hyperparameters as
  ``optimizer.param_groups.<param name>.<key>`` (flattened optimizer state dicts).

Each stored piece of a parameter or state tensor is one or more DCP chunks at its place in
the global tensor: a rank's block (``model.slices``), a whole replicated tensor, or a share
(a flat run of elements, cut into the few boxes that are contiguous in it). A rank reads of
each stored tensor only the byte range its requests span, widened to whole checksum chunks
(``CheckpointWriter(chunk_bytes=...)``, 4 MiB by default), each chunk checked against its
crc32c. The digests of the live state at F, which ``gockpt.load`` compares on the same shape,
are of whole stored tensors: this path checks the checksums only.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ..core.errors import CorruptCheckpointError, GockptError, LoadError
from .format import CODE_TO_DTYPE, MANIFEST_FILE
from .dcp_uploads import wait_uploads
from .dcp_writer import GockptWriter
from .index import boxes_problem
from .manifest import parse, parts_of
from .manifest_file import read_manifest
from .reader import read_spans, read_tensors
from .refs import inverse, permuted
from .schema import WRITTEN_BY_DCP, Manifest, is_small_tensor
from .statedict import optimizer_state_dict

__all__ = ["GockptReader", "GockptWriter", "load", "wait_uploads"]


@dataclass(frozen=True)
class Piece:
    """Where one DCP chunk lies: in stored tensor ``tensor`` of the part at ``part`` (relative
    to the checkpoint), its elements in memory order from the stored tensor's flat element
    ``base`` on, in memory shape ``memory`` (the chunk's shape permuted by ``dims``: its
    memory order) -- or, for the small state, the ``value`` itself."""

    part: str = ""
    tensor: Optional[str] = None
    base: int = 0
    memory: Tuple[int, ...] = ()
    dims: Tuple[int, ...] = ()
    value: object = None

    def span(self, offsets, lengths) -> Tuple[int, int, tuple, tuple]:
        """Of the box at ``offsets`` with ``lengths`` of the chunk (its own order): the range
        of the stored tensor's flat elements that holds it (first, end), and the box in memory
        order (sizes, strides) from its first element."""
        dims = self.dims or tuple(range(len(self.memory)))
        at, sizes = permuted(offsets, dims), permuted(lengths, dims)
        strides = [math.prod(self.memory[d + 1:]) for d in range(len(self.memory))]
        first = self.base + sum(o * s for o, s in zip(at, strides))
        if 0 in sizes:
            return first, first, sizes, tuple(strides)
        last = first + sum((n - 1) * s for n, s in zip(sizes, strides))
        return first, last + 1, sizes, tuple(strides)


def load(state: dict, reader: "GockptReader", *, alone: bool) -> None:
    """``torch.distributed.checkpoint.load(state, storage_reader=reader)``; ``alone``: this
    process loads by itself (no collective, and without DCP's warning that it does).

    DCP gathers every rank's failure into one ``CheckpointException`` (a BaseException, raised
    on every rank): the first rank's gockpt error (a checksum mismatch naming the file and
    tensor) is raised as itself, anything else as a LoadError saying what failed where."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=alone)
    except CheckpointException as exc:
        failures = [(rank, exc.failures[rank][0]) for rank in sorted(exc.failures)]
        ours = [e for _, e in failures if isinstance(e, GockptError)]
        if ours:
            raise ours[0] from exc
        rank, first = failures[0] if failures else (None, exc)
        raise LoadError(f"{reader.path}: torch.distributed.checkpoint could not load it (rank "
                        f"{rank}): {type(first).__name__}: {first}") from exc


def flat_boxes(shape: Tuple[int, ...], lo: int, hi: int) -> List[Tuple[int, tuple, tuple]]:
    """The elements [lo, hi) of a row-major tensor of ``shape`` as boxes (flat start,
    offsets, sizes), each contiguous in memory, in order: at most two per dimension."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out, at = [], lo
    while at < hi:
        for d, unit in enumerate(strides):  # the outermost dimension ``at`` is aligned to
            if at % unit == 0 and at + unit <= hi:
                before = (at // unit) % shape[d]
                count = min((hi - at) // unit, shape[d] - before)
                offsets = tuple((at // s) % n for s, n in zip(strides, shape))
                out.append((at, offsets, (1,) * d + (count,) + tuple(shape[d + 1:])))
                at += count * unit
                break
    return out


class GockptReader(StorageReader):
    """``torch.distributed.checkpoint.StorageReader`` over the gockpt checkpoint at ``path``
    (a checkpoint directory; ``gockpt.storage.resolve(run_dir)`` gives the latest).
    ``verify=False`` skips the crc32c check of what is read."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True):
        super().__init__()
        self.path, self.verify = str(path), verify
        self.storage_data: Dict[MetadataIndex, Piece] = {}
        self.read_bytes = 0  # bytes of stored tensors this reader has read (this rank)
        self._metadata: Optional[Metadata] = None  # of ``path``, once built
        self.owners: Dict[int, str] = {}  # optimizer state index -> parameter, once built

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.path:
            self.path, self._metadata, self.owners = str(checkpoint_id), None, {}
        self.read_bytes = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return os.path.isfile(os.path.join(str(checkpoint_id), MANIFEST_FILE))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """DCP's metadata of the checkpoint (built once per path: the manifests, the global
        index, the small state read and checked); ``owners`` then maps each optimizer state
        index to its parameter, as every part together says."""
        if self._metadata is None:
            state, storage, self.owners = _Metadata(self.path, self.verify).build()
            self._metadata = Metadata(state_dict_metadata=state, storage_data=storage)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args,
                              **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        spans: Dict[str, Dict[str, list]] = {}  # part -> stored name -> element ranges wanted
        for item in plan.items:
            piece = self.storage_data[item.storage_index]
            if piece.tensor is not None:
                first, end, _, _ = piece.span(item.storage_offsets, item.lengths)
                spans.setdefault(piece.part, {}).setdefault(piece.tensor, []).append((first, end))
        runs: Dict[str, dict] = {}  # part -> stored name -> [(first element, elements read)]
        for part, wanted in spans.items():
            ppath = os.path.join(self.path, part) if part else self.path
            runs[part] = read_spans(ppath, read_manifest(ppath), wanted, verify=self.verify)
            self.read_bytes += sum(t.numel() * t.element_size()
                                   for got in runs[part].values() for _, t in got)
        for item in plan.items:
            piece = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(piece.value, buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            if piece.tensor is None:
                chunk = piece.value
                for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                    chunk = chunk.narrow(d, o, n)
            else:
                chunk = _box(piece, item, runs[piece.part][piece.tensor])
            target = planner.resolve_tensor(item).detach()
            target.copy_(chunk)
            planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def _box(piece: Piece, item, runs: list) -> torch.Tensor:
    """The box ``item`` asks of ``piece``, in the chunk's own order: a view of the run read
    that holds it."""
    first, end, sizes, strides = piece.span(item.storage_offsets, item.lengths)
    lo, run = next((lo, t) for lo, t in runs if lo <= first and end <= lo + t.numel())
    box = run.as_strided(sizes, strides, run.storage_offset() + first - lo)
    return box.permute(inverse(piece.dims)) if piece.dims else box


class _Metadata:
    """DCP's metadata of one gockpt checkpoint, from its manifests."""

    def __init__(self, path: str, verify: bool):
        self.path, self.verify = path, verify
        self.state: Dict[str, object] = {}
        self.storage: Dict[MetadataIndex, Piece] = {}

    def build(self):
        data = read_manifest(self.path)
        names = parts_of(self.path, data)
        if names is None:
            parts = [("", parse(self.path, data))]
        else:
            parts = [(n, parse(os.path.join(self.path, n), read_manifest(
                os.path.join(self.path, n)))) for n in names]
            if data.get("replicated") is True and data.get("shares") is not True:
                parts = parts[:1]  # every part holds the whole state
            elif data.get("shares") is not True:
                for n, m in parts:
                    alone = sorted(set(m.model.params) - set(m.model.slices))
                    if alone:
                        raise LoadError(
                            f"{self.path}: rank {m.rank}'s part holds {alone[0]!r} as its own "
                            "state, no slice of a global tensor (Config.replicated=False on "
                            f"{len(parts)} ranks): it loads only on as many ranks, each its "
                            "own part")
        # each part names the parameters whose state it stores: together, every one
        owners = {k: v for _, m in parts for k, v in (m.optimizer.params.items()
                                                       if m.optimizer else ())}
        for part, m in parts:
            self._add_part(part, m, owners)
        self._check_cover()
        self._add_small(*parts[0], owners)
        return self.state, self.storage, owners

    def _add_part(self, part: str, m: Manifest, owners: Dict[int, str]) -> None:
        for _, what, ref, (idx, key) in m.stored_refs():
            param = key if idx is None else owners.get(idx)
            if param is None:
                raise CorruptCheckpointError(
                    f"{os.path.join(self.path, part)}: {what} names no parameter "
                    "(a checkpoint written before gockpt recorded optimizer.params)")
            names = _model_names(param, m) if idx is None else [f"optimizer.state.{param}.{key}"]
            local = tuple(m.logical_shape(ref))
            s = m.model.slices.get(param)
            shape = tuple(s["shape"]) if s else local
            at = tuple(s["offsets"]) if s else (0,) * len(local)
            dtype = CODE_TO_DTYPE[m.tensors[ref.tensor]["dtype"]]
            dims = tuple(ref.dims)
            memory = permuted(local, dims) if dims else local
            if ref.extent is None:  # whole (a pack's from its offset on)
                boxes = [(0, (0,) * len(local), memory)]
            else:  # a share: its elements from extent[0] lie at ref.offset
                boxes = flat_boxes(memory, *ref.extent)
            for start, off, size in boxes:
                base = ref.offset + start - (ref.extent[0] if ref.extent is not None else 0)
                piece = Piece(part, ref.tensor, base, tuple(size), dims)
                if dims:  # a box in memory order -> in the tensor's own order
                    off, size = permuted(off, inverse(dims)), permuted(size, inverse(dims))
                self._add_chunk(names, dtype, shape, tuple(a + o for a, o in zip(at, off)),
                                size, piece, what)

    def _add_chunk(self, names, dtype, shape, offsets, sizes, piece, what) -> None:
        for name in names:
            md = self.state.get(name)
            if md is None:
                md = self.state[name] = TensorStorageMetadata(
                    TensorProperties(dtype=dtype), torch.Size(shape), [])
            elif md.properties.dtype != dtype or tuple(md.size) != tuple(shape):
                raise CorruptCheckpointError(
                    f"{self.path}: the parts store {what} as {dtype} of {list(shape)} and as "
                    f"{md.properties.dtype} of {list(md.size)}")
            index = MetadataIndex(name, torch.Size(offsets))
            if index in self.storage:
                continue  # a copy of a block another part holds too (replicas)
            md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            self.storage[index] = piece

    def _check_cover(self) -> None:
        """Every tensor covered by its chunks exactly once (a gap or an overlap: a damaged
        checkpoint, named)."""
        for name, md in self.state.items():
            problem = boxes_problem(name, tuple(md.size), [(tuple(c.offsets), tuple(c.sizes))
                                                           for c in md.chunks])
            if problem:
                raise CorruptCheckpointError(f"{self.path}: {problem}")

    def _add_small(self, part: str, m: Manifest, owners: Dict[int, str]) -> None:
        """Buffers, the optimizer's step counters and hyperparameters, from the small state of
        one part (what every rank holds alike)."""
        ppath = os.path.join(self.path, part) if part else self.path
        tensors = read_tensors(ppath, m, [n for n in m.tensors if is_small_tensor(n)],
                               verify=self.verify)
        for name, value in m.small.decode("model", tensors).items():
            if isinstance(value, torch.Tensor):
                self._add_value([name, f"model.{name}"], value)
        if m.mode == WRITTEN_BY_DCP:  # GockptWriter's: the rest of the state under its names
            for name, value in (m.small.decode("extra_state", tensors) or {}).items():
                if isinstance(value, torch.Tensor):
                    self._add_value([name], value)
                else:
                    self._add_bytes(name, value)
        if m.optimizer is None:
            return
        sd = optimizer_state_dict(m, ppath, tensors, aligned=False)
        for idx, values in sd["state"].items():
            param = owners.get(idx)
            for key, value in values.items():
                if param is not None and isinstance(value, torch.Tensor):
                    self._add_value([f"optimizer.state.{param}.{key}"], value)
        for gi, group in enumerate(sd["param_groups"]):
            for key, value in group.items():  # get_state_dict's: a list of groups
                if key == "params":
                    value = [owners.get(i, str(i)) for i in value]
                self._add_bytes(f"optimizer.param_groups.{gi}.{key}", value)
            for idx in group["params"]:  # flatten_optimizer_state_dict's: per parameter
                if idx in owners:
                    for key, value in group.items():
                        if key != "params":
                            self._add_bytes(f"optimizer.param_groups.{owners[idx]}.{key}",
                                            value)

    def _add_bytes(self, name: str, value) -> None:
        self.state[name] = BytesStorageMetadata()
        self.storage[MetadataIndex(name)] = Piece(value=value)

    def _add_value(self, names, value: torch.Tensor) -> None:
        for name in names:
            zeros = torch.Size((0,) * value.dim())
            self.state[name] = TensorStorageMetadata(
                TensorProperties(dtype=value.dtype), value.shape,
                [ChunkStorageMetadata(zeros, value.shape)])
            self.storage[MetadataIndex(name, zeros)] = Piece(value=value.clone())


def _model_names(param: str, m: Manifest) -> List[str]:
    """DCP's names of a parameter: its own and its tied aliases, flat and under ``model.``."""
    names = [param] + [a for a, c in m.model.aliases.items() if c == param]
    return names + [f"model.{n}" for n in names]

