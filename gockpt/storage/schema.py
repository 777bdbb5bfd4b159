"""The manifest of a gockpt checkpoint as data: its typed sections, and every name a stored
tensor or a rank's part has. The one module that knows these fields (:mod:`.manifest` parses
and validates them from untrusted JSON).

``manifest.json`` holds the storage format's own fields (``manifest_crc32c``, ``format``,
``format_version`` and the ``tensors`` table, written and validated by :mod:`.writer` /
:mod:`.reader`) and gockpt's:

    step, start_step, mode, overlap_steps   which version F, captured how
    rank, world_size                        this part's place among the ranks
    model      {"params": {state_dict name: stored tensor}, "aliases": {tied name: name},
                "digests": {state_dict name: digest of the live tensor at F}}
    optimizer  {"class": name, "aligned": {state index: {key: stored tensor}},
                "digests": {state index: {key: digest}}}
    small      everything small at F, as gockpt.storage.tree-encoded JSON:
               model (buffers), optimizer (param groups, steps), scheduler, rng, extra_state
    metrics    what the checkpoint cost (gockpt.core.metrics.CheckpointMetrics)

A checkpoint written by several ranks has a top-level manifest without tensors that lists its
parts (``"ranks": ["rank-00000", ...]``); each part is a complete single-rank checkpoint of
what its rank holds -- all of its state, or, when replicas split one state (``"shares":
true``), a share of it: then a tensor's reference says which of its elements it holds
(``extent``, :mod:`.refs`), and the parts together hold each element once.

Stored tensors are named ``model/<name>`` (a parameter), ``optim/<index>/<key>`` (an aligned
optimizer state tensor), ``pack/model/<dtype>`` and ``pack/optim/<key>/<dtype>`` (many small
ones back to back, :mod:`.layout`) and ``small/<section>/<n>`` (tensors of the small state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Optional, Tuple

from ..core.errors import CorruptCheckpointError
from . import tree
from .refs import TensorRef

WRITTEN_BY_DCP = "dcp"
"""The ``mode`` of a checkpoint that torch.distributed.checkpoint wrote through
:class:`gockpt.storage.dcp_writer.GockptWriter` (each part holds what DCP's planner gave its
rank: ``gockpt.load`` loads it through DCP's planner; its extra state is under DCP's names)."""

# ------------------------------------------------------------------ stored tensor names

SMALL_SECTIONS = ("model", "optimizer", "scheduler", "rng", "extra_state")


def param_tensor(name: str) -> str:
    """Stored name of the model parameter ``name`` (its ``state_dict`` name)."""
    return f"model/{name}"


def optim_tensor(index: int, key: str) -> str:
    """Stored name of the aligned optimizer state ``key`` of the ``index``-th parameter."""
    return f"optim/{index}/{key}"


def small_prefix(section: str) -> str:
    """Prefix of the tensors inside the small-state section ``section``."""
    return f"small/{section}"


def is_small_tensor(name: str) -> bool:
    return name.startswith("small/")


# ------------------------------------------------------------------ parts of several ranks

def pack_name(role: Optional[str], dtype_code: str) -> str:
    """Stored name of the pack of small tensors of ``role`` (None: parameters, else an
    optimizer state key) and dtype code."""
    return f"pack/model/{dtype_code}" if role is None else f"pack/optim/{role}/{dtype_code}"


def pack_prefix(role: Optional[str]) -> str:
    """What the names of the packs of ``role`` begin with."""
    return "pack/model/" if role is None else f"pack/optim/{role}/"


def part_name(rank: int) -> str:
    """Directory name of the part written by ``rank``."""
    return f"rank-{rank:05d}"


def check_part_name(path: str, name) -> str:
    """``name`` if it is a plain directory name inside the checkpoint, else CorruptCheckpointError."""
    if not isinstance(name, str) or name in ("", ".", "..") or name.startswith(".") \
            or any(c in name for c in "/\\\0") or not name.isprintable() or len(name) > 255 \
            or not all(c.isascii() for c in name):
        raise CorruptCheckpointError(f"checkpoint {path!r}: invalid part name {name!r:.60} in "
                                     "the manifest")
    return name


# ------------------------------------------------------------------ typed sections

@dataclass
class ModelSection:
    """Where the model's parameters are stored."""

    params: Dict[str, TensorRef]
    """``state_dict`` name of each planned parameter -> where it is stored."""
    aliases: Dict[str, str] = field(default_factory=dict)
    """Extra ``state_dict`` names of tied parameters -> their canonical name."""
    digests: Dict[str, str] = field(default_factory=dict)
    """``state_dict`` name -> the digest (:mod:`gockpt.core.digest`, 32 hex digits) of the
    live parameter at F; empty in checkpoints written without verification."""
    slices: Dict[str, dict] = field(default_factory=dict)
    """``state_dict`` name of each DTensor parameter (FSDP2, tensor parallelism) -> its global
    ``shape`` and the ``offsets`` of this part's local shard in it (:mod:`.index`)."""

    def expected(self) -> Dict[str, TensorRef]:
        """Every ``state_dict`` name the parameters answer to (aliases included) -> ref."""
        out = dict(self.params)
        out.update({alias: self.params[name] for alias, name in self.aliases.items()
                    if name in self.params})
        return out


@dataclass
class OptimizerSection:
    """What the optimizer's ``state_dict`` needs besides the small state."""

    cls: str
    """Class name of the optimizer that was checkpointed."""
    aligned: Dict[int, Dict[str, TensorRef]] = field(default_factory=dict)
    """Optimizer state index -> key -> where that state tensor (of the parameter's shape) is
    stored."""
    digests: Dict[int, Dict[str, str]] = field(default_factory=dict)
    """Optimizer state index -> key -> the digest of the live state tensor at F."""
    params: Dict[int, str] = field(default_factory=dict)
    """Optimizer state index -> the parameter (``state_dict`` name) whose state it is, for each
    index whose aligned state this part stores (empty in earlier checkpoints, where the
    optimizer's order alone said it)."""


class _Absent:
    """The type of :data:`ABSENT`."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
"""A small section that a damaged manifest lacks, in a :meth:`Manifest.tolerant` view."""


@dataclass
class SmallSection:
    """Everything small at version F, each a :mod:`gockpt.storage.tree` encoding whose tensors
    are stored under :func:`small_prefix` of its section."""

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    rng: Any = None
    extra_state: Any = None

    @classmethod
    def encode(cls, values: Dict[str, Any], fresh: Collection[int] = ()
               ) -> Tuple["SmallSection", Dict[str, Any]]:
        """The sections ``values`` (section -> Python value, as taken at F) encoded
        (:func:`gockpt.storage.tree.encode`: tensors copied out -- but those whose id() is in
        ``fresh``, copies of their own --, never pickled), and the stored tensors they refer
        to. TypeError/ValueError for a value that cannot be stored."""
        tensors: Dict[str, Any] = {}
        return cls(**{s: tree.encode(values[s], tensors, small_prefix(s), inline_scalars=True,
                                     fresh=fresh)
                      for s in SMALL_SECTIONS}), tensors

    def decode(self, section: str, tensors: dict):
        """The Python value of ``section`` given the stored tensors it refers to (ValueError if
        the encoding is malformed, or the section is :data:`ABSENT`)."""
        value = getattr(self, section)
        if value is ABSENT:
            raise ValueError(f"no {small_prefix(section)} section")
        return tree.decode(value, tensors)

    def tensor_refs(self, section: str) -> Dict[str, str]:
        """Stored tensor name -> where it sits in ``section``'s value (``state[0]['exp_avg']``),
        read from the encoding alone (no data, nothing decoded; malformed parts are skipped)."""
        return tree.tensor_refs(getattr(self, section))


@dataclass
class Manifest:
    """gockpt's fields of one (single-rank, or one rank's part) checkpoint manifest."""

    step: int
    """The user's step number at version F."""
    start_step: int
    """The step boundary at which the checkpoint started (F = start_step + K - 1)."""
    mode: str
    overlap_steps: int
    model: ModelSection
    small: SmallSection
    optimizer: Optional[OptimizerSection] = None
    rank: int = 0
    world_size: int = 1
    replicated: bool = False
    """Every rank held the same state (data parallelism): loadable on another number of ranks."""
    metrics: Dict[str, Any] = field(default_factory=dict)
    tensors: Dict[str, dict] = field(default_factory=dict)
    """The storage format's validated tensor table (read only; the writer produces it)."""

    def to_json(self) -> dict:
        """The fields gockpt writes (the storage writer adds format, version and tensors)."""
        out = {"step": self.step, "start_step": self.start_step, "mode": self.mode,
               "overlap_steps": self.overlap_steps, "rank": self.rank,
               "world_size": self.world_size,
               "model": {"params": {n: r.to_json() for n, r in self.model.params.items()},
                         "aliases": dict(self.model.aliases),
                         "digests": dict(self.model.digests),
                         **({"slices": dict(self.model.slices)} if self.model.slices else {})},
               # shallow: asdict() would deep-copy thousands of encoded values
               "small": {s: getattr(self.small, s) for s in SMALL_SECTIONS},
               "metrics": dict(self.metrics)}
        if self.replicated:
            out["replicated"] = True
        if self.optimizer is not None:
            out["optimizer"] = {"class": self.optimizer.cls,
                                "aligned": {str(i): {k: r.to_json() for k, r in refs.items()}
                                            for i, refs in self.optimizer.aligned.items()},
                                "digests": {str(i): dict(d) for i, d in
                                            self.optimizer.digests.items()}}
            if self.optimizer.params:
                out["optimizer"]["params"] = {str(i): n for i, n in
                                              self.optimizer.params.items()}
        return out

    def stored_refs(self) -> List[Tuple[str, str, TensorRef, tuple]]:
        """(the tensor's own stored name, what it is -- for a message --, its reference,
        ``(None, parameter name)`` or ``(state index, key)``) of every parameter and aligned
        optimizer state tensor."""
        refs = [(param_tensor(n), f"parameter {n!r}", r, (None, n))
                for n, r in self.model.params.items()]
        for idx, by_key in (self.optimizer.aligned if self.optimizer is not None else {}).items():
            refs += [(optim_tensor(idx, k), f"optimizer state [{idx}][{k!r}]", r, (idx, k))
                     for k, r in by_key.items()]
        return refs

    def digest_checks(self) -> List[Tuple[str, TensorRef, str]]:
        """(what, reference, digest) of every parameter and optimizer state tensor whose
        digest at F the checkpoint recorded (``what`` names it for a message)."""
        checks = [(f"parameter {name!r}", self.model.params[name], d)
                  for name, d in self.model.digests.items() if name in self.model.params]
        if self.optimizer is not None:
            for idx, by_key in self.optimizer.digests.items():
                refs = self.optimizer.aligned.get(idx, {})
                checks += [(f"optimizer state [{idx}][{key!r}]", refs[key], d)
                           for key, d in by_key.items() if key in refs]
        return checks


    def logical_shape(self, ref: TensorRef) -> Tuple[int, ...]:
        """The shape of the tensor ``ref`` refers to (from the tensor table, nothing read)."""
        return ref.logical_shape(self.tensors[ref.tensor]["shape"])

@dataclass
class PartsManifest:
    """The top-level manifest of a checkpoint written by several ranks."""

    step: int
    start_step: int
    mode: str
    overlap_steps: int
    parts: List[str]
    """Part directory of each rank, in rank order."""
    replicated: bool = False
    """Every rank held the same state (see :attr:`Manifest.replicated`)."""
    shares: bool = False
    """The replicas split that state: each part holds a share of it (its tensors' references
    carry an ``extent``), and a load gathers every part."""
    index: Dict[str, dict] = field(default_factory=dict)
    """The global index (:mod:`.index`): per parameter stored in slices or shares, its global
    shape, dtype and which part holds which slice."""

    def to_json(self) -> dict:
        out = {"step": self.step, "start_step": self.start_step, "mode": self.mode,
               "overlap_steps": self.overlap_steps, "world_size": len(self.parts),
               "ranks": list(self.parts)}
        if self.replicated:
            out["replicated"] = True
        if self.shares:
            out["shares"] = True
        if self.index:
            out["index"] = self.index
        return out
