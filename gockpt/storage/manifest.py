"""The manifest of a gockpt checkpoint: its typed sections, the names of stored tensors, the
parts written by several ranks, and their validation. The one module that knows these fields.

``manifest.json`` holds the storage format's own fields (``format``, ``format_version`` and the
``tensors`` table, written and validated by :mod:`.writer` / :mod:`.reader`) and gockpt's:

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
parts (``"ranks": ["rank-00000", ...]``); each part is a complete single-rank checkpoint.

Everything here is read from untrusted files: :meth:`Manifest.from_json` checks every field's
type before anyone uses it and raises :class:`~gockpt.core.errors.CorruptCheckpointError` naming the
checkpoint and the field.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..core.digest import is_hex
from ..core.errors import CorruptCheckpointError, LoadError
from . import tree
from .reader import read_manifest
from .refs import TensorRef

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
                         "digests": dict(self.model.digests)},
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
        return out

    @classmethod
    def from_json(cls, path: str, data: dict) -> "Manifest":
        """Typed view of a manifest read by :func:`gockpt.storage.read_manifest`.

        Raises CorruptCheckpointError naming ``path`` and the field when a section is missing
        or of the wrong type (a manifest that is not gockpt's, or was damaged)."""
        def bad(msg):
            return CorruptCheckpointError(f"checkpoint {path!r}: manifest: {msg}; is this a "
                                          "gockpt checkpoint?")

        for key in ("step", "start_step", "overlap_steps"):
            if not _is_int(data.get(key)):
                raise bad(f"{key!r} is {data.get(key)!r:.40}, expected an int")
        if not isinstance(data.get("mode"), str):
            raise bad("'mode' is missing")
        model = data.get("model")
        params = _refs(model.get("params")) if isinstance(model, dict) else None
        if params is None or not _str_map(model.get("aliases", {})):
            raise bad("the 'model' section is missing or malformed")
        model_digests = _digests(model.get("digests", {}))
        if model_digests is None or not set(model_digests) <= set(params):
            raise bad("the model's 'digests' are malformed or name parameters it does not have")
        small = data.get("small")
        if not isinstance(small, dict) or any(s not in small for s in SMALL_SECTIONS):
            raise bad("the 'small' section is missing or incomplete")
        optimizer = None
        opt = data.get("optimizer")
        if opt is not None:
            aligned = _aligned(opt.get("aligned", {})) if isinstance(opt, dict) else None
            if aligned is None or not isinstance(opt.get("class"), (str, type(None))):
                raise bad("the 'optimizer' section is malformed")
            state_digests = _state_digests(opt.get("digests", {}))
            if state_digests is None or any(not set(d) <= set(aligned.get(i, {}))
                                            for i, d in state_digests.items()):
                raise bad("the optimizer's 'digests' are malformed or name state it does not "
                          "store")
            optimizer = OptimizerSection(opt.get("class") or "", aligned, state_digests)
        for key in ("rank", "world_size"):
            if key in data and not _is_int(data[key]):
                raise bad(f"{key!r} is {data[key]!r:.40}, expected an int")
        if not isinstance(data.get("replicated", False), bool):
            raise bad(f"'replicated' is {data['replicated']!r:.40}, expected true or false")
        metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else {}
        return cls(step=data["step"], start_step=data["start_step"], mode=data["mode"],
                   overlap_steps=data["overlap_steps"],
                   model=ModelSection(params, dict(model.get("aliases", {})), model_digests),
                   small=SmallSection(**{s: small[s] for s in SMALL_SECTIONS}),
                   optimizer=optimizer, rank=data.get("rank", 0),
                   world_size=data.get("world_size", 1),
                   replicated=data.get("replicated", False), metrics=metrics,
                   tensors=data.get("tensors", {}))._checked(bad)

    def _checked(self, bad) -> "Manifest":
        """Every reference must point into a stored tensor of its role (a parameter into its
        own ``model/<name>`` or a pack of parameters, a state tensor into its own
        ``optim/<index>/<key>`` or a pack of that key), within its bounds, and no two may
        share a byte: a swapped, duplicated or renamed reference is refused here, before
        anything is read."""
        refs = [(f"parameter {n!r}", r, param_tensor(n), "pack/model/")
                for n, r in self.model.params.items()]
        for idx, by_key in (self.optimizer.aligned if self.optimizer else {}).items():
            refs += [(f"optimizer state [{idx}][{k!r}]", r, optim_tensor(idx, k), f"pack/optim/{k}/")
                     for k, r in by_key.items()]
        spans: Dict[str, list] = {}
        for what, ref, own, pack in refs:
            entry = self.tensors.get(ref.tensor)
            if entry is None:
                raise bad(f"{what} refers to tensor {ref.tensor!r}, which is not stored")
            if ref.tensor != own if ref.shape is None else not ref.tensor.startswith(pack):
                raise bad(f"{what} refers to tensor {ref.tensor!r}; it is stored as {own!r} "
                          f"or in a {pack}* pack")
            problem = ref.check(entry["shape"])
            if problem:
                raise bad(f"{what}: reference into {ref.tensor!r}: {problem}")
            first = ref.offset if ref.shape is not None else 0
            spans.setdefault(ref.tensor, []).append(
                (first, first + math.prod(ref.logical_shape(entry["shape"])), what))
        for tensor, taken in spans.items():
            taken.sort()
            for (_, end, what), (start, _, other) in zip(taken, taken[1:]):
                if start < end:
                    raise bad(f"{what} and {other} share elements of stored tensor {tensor!r}")
        return self

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

    @classmethod
    def tolerant(cls, data: dict) -> "Manifest":
        """Best-effort typed view of a manifest that may be damaged or not gockpt's, for tools
        that describe or check a checkpoint (never for restoring one); raises nothing.

        ``step``, ``start_step``, ``mode``, ``overlap_steps``, ``rank`` and ``world_size`` are
        as found (None when absent), ``metrics`` None unless a dict; a malformed model section
        reads as empty, a malformed optimizer section as None (malformed ``aligned``: empty),
        a missing small section as :data:`ABSENT`."""
        def get(section) -> dict:
            return data.get(section) if isinstance(data.get(section), dict) else {}

        params, aliases = _refs(get("model").get("params")), get("model").get("aliases", {})
        opt = data.get("optimizer")
        optimizer = None if not isinstance(opt, dict) else OptimizerSection(
            opt.get("class") or "", _aligned(opt.get("aligned") or {}) or {},
            _state_digests(opt.get("digests") or {}) or {})
        scalars = ("step", "start_step", "mode", "overlap_steps", "rank", "world_size")
        return cls(**{k: data.get(k) for k in scalars},
                   model=ModelSection(params or {},
                                      dict(aliases) if _str_map(aliases) else {},
                                      _digests(get("model").get("digests") or {}) or {}),
                   small=SmallSection(**{s: get("small").get(s, ABSENT) for s in SMALL_SECTIONS}),
                   optimizer=optimizer, tensors=data.get("tensors", {}),
                   metrics=data["metrics"] if isinstance(data.get("metrics"), dict) else None)

    def optimizer_state_dict(self, path: str, tensors: dict, optimizer=None,
                             aligned: bool = True) -> dict:
        """The optimizer's ``state_dict`` at F from the small state and the aligned tensors
        (``aligned=False``: without the aligned tensors, to check the structure cheaply).

        With ``optimizer`` given, raises LoadError if its class, number of param groups or
        of parameters differs from the checkpoint's."""
        opt = self.optimizer
        if optimizer is not None and opt is not None and opt.cls \
                and opt.cls != type(optimizer).__name__:
            raise LoadError(f"{path}: saved with optimizer {opt.cls}, loading into "
                            f"{type(optimizer).__name__}")
        small = self.small.decode("optimizer", tensors)
        if optimizer is not None:
            n_live = sum(len(g["params"]) for g in optimizer.param_groups)
            n_saved = sum(len(g["params"]) for g in small["param_groups"])
            if n_live != n_saved or len(small["param_groups"]) != len(optimizer.param_groups):
                raise LoadError(f"{path}: the optimizer has {len(optimizer.param_groups)} "
                                f"groups / {n_live} parameters, the checkpoint "
                                f"{len(small['param_groups'])} / {n_saved}")
        state = expand_columns(small)
        if aligned and opt is not None:
            for idx, refs in opt.aligned.items():
                for key, ref in refs.items():
                    t = ref.resolve(tensors)  # a packed one gets storage of its own
                    state.setdefault(idx, {})[key] = t if ref.shape is None else t.clone()
        return {"state": state, "param_groups": small["param_groups"]}


def expand_columns(small: dict) -> dict:
    """The per-parameter state of a decoded optimizer small section, with the gathered
    scalar columns (see gockpt.capture.smallstate.optimizer_small) put back in place as 0-dim
    tensors of their own."""
    state = small["state"]
    for key, groups in (small.get("columns") or {}).items():
        for group in groups:
            values = group["values"]
            if len(group["index"]) != values.numel():
                raise ValueError(f"scalar column {key!r}: {len(group['index'])} indices for "
                                 f"{values.numel()} values")
            for i, idx in enumerate(group["index"]):
                state.setdefault(idx, {})[key] = values[i].clone()
    return state


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

    def to_json(self) -> dict:
        out = {"step": self.step, "start_step": self.start_step, "mode": self.mode,
               "overlap_steps": self.overlap_steps, "world_size": len(self.parts),
               "ranks": list(self.parts)}
        if self.replicated:
            out["replicated"] = True
        return out


def parts_of(path: str, data: dict) -> Optional[List[str]]:
    """The validated part names of a multi-rank checkpoint's manifest; None for one rank."""
    ranks = data.get("ranks")
    if ranks is None:
        return None
    if not isinstance(ranks, list) or not ranks:
        raise CorruptCheckpointError(f"checkpoint {path!r}: manifest 'ranks' is {ranks!r:.60}, "
                                     "expected a non-empty list of part directory names")
    return [check_part_name(path, p) for p in ranks]


def read(path: str, rank: Optional[int] = None, live_world: int = 1, live_rank: int = 0,
         target_replicated: bool = False) -> Tuple[str, Manifest]:
    """(directory, typed manifest) of the checkpoint at ``path``, or of one rank's part of it
    when several ranks wrote it: ``rank``'s when given (any world size: the caller chose),
    else the loading rank's (``live_rank`` of ``live_world`` ranks).

    The world size must be the one that wrote it -- unless the checkpoint records replicated
    state (each rank then reads part ``live_rank % parts``), or one rank wrote it and the
    target is a replica (``target_replicated``: every rank loads the whole state). Anything
    else is a LoadError: per-rank state is not resharded (yet), never guessed."""
    data = read_manifest(path)
    parts = parts_of(path, data)
    written = len(parts) if parts is not None else 1
    if rank is None:
        if live_world != written and not (data.get("replicated") is True
                                          or (written == 1 and target_replicated)):
            raise LoadError(
                f"{path} was written by {written} rank{'s' if written > 1 else ''} and holds "
                f"per-rank state; this job has {live_world}. Load it on {written} "
                f"rank{'s' if written > 1 else ''} (loading on another number of ranks needs "
                "the state to be replicated, e.g. DistributedDataParallel, or "
                "Config(replicated=True)), or pass rank=R to read one rank's part on purpose")
        rank = live_rank % written
    if parts is not None:
        if not _is_int(rank) or not rank < len(parts):
            raise LoadError(f"{path} has parts for ranks 0..{len(parts) - 1}; rank {rank!r} asked")
        path = os.path.join(path, parts[rank])
        data = read_manifest(path)
    return path, Manifest.from_json(path, data)


def _is_int(x) -> bool:
    return type(x) is int and x >= 0


def _is_index(x) -> bool:
    """An optimizer state index: an int, or its decimal string (JSON object keys)."""
    return isinstance(x, str) and x.isascii() and x.isdigit() or _is_int(x)


def _aligned(x) -> Optional[Dict[int, Dict[str, TensorRef]]]:
    """An optimizer section's ``aligned`` map with int indices; None if malformed. The format
    of earlier checkpoints lists only the keys, stored under :func:`optim_tensor` names."""
    if not isinstance(x, dict) or not all(_is_index(i) for i in x):
        return None
    out = {}
    for i, keys in x.items():
        if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
            out[int(i)] = {k: TensorRef(optim_tensor(int(i), k)) for k in keys}
        else:
            refs = _refs(keys)
            if refs is None:
                return None
            out[int(i)] = refs
    return out


def _refs(x) -> Optional[Dict[str, TensorRef]]:
    """A map of names to references; None if malformed."""
    if not isinstance(x, dict):
        return None
    out = {k: TensorRef.from_json(v) for k, v in x.items() if isinstance(k, str)}
    return None if len(out) != len(x) or None in out.values() else out


def _digests(x) -> Optional[Dict[str, str]]:
    """A map of names to digests; None if malformed."""
    if not isinstance(x, dict) or not all(isinstance(k, str) and is_hex(v) for k, v in x.items()):
        return None
    return dict(x)


def _state_digests(x) -> Optional[Dict[int, Dict[str, str]]]:
    """An optimizer section's ``digests``: index -> key -> digest; None if malformed."""
    if not isinstance(x, dict) or not all(_is_index(i) for i in x):
        return None
    out = {int(i): _digests(d) for i, d in x.items()}
    return None if None in out.values() else out


def _str_map(x) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, str)
                                       for k, v in x.items())
