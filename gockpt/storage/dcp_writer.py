"""gockpt's format written by torch.distributed.checkpoint (DCP): :class:`GockptWriter`, a
``StorageWriter`` for ``dcp.save`` / ``dcp.async_save`` (torchtitan's checkpoint manager among
them): parallel O_DIRECT writes, a crc32c per chunk, JSON manifests, the global index, an
atomic commit, ``latest``; ``gockpt verify``, ``gockpt.load``, the reader take them, and its
own uploads (``remote=``) put them in an object store.

What DCP's flattened names become (the inverse of what the reader offers; the table in
docs/dcp.md): ``model.<name>`` tensors (and any other tensor of one or more dimensions outside
``optimizer.``) the parameter ``<name>``, each rank's chunk a slice of the global tensor;
``optimizer.state.<param>.<key>`` its aligned optimizer state (in the same part as the
parameter's chunk: the coordinator hands a replicated moment to the rank that writes its
parameter) or its small state (0-dim: Adam's ``step``); ``optimizer.param_groups.*`` the param
groups; anything else the small state's ``extra_state`` under its DCP name (values gockpt
encodes without pickle; anything else is refused, naming it).

The coordinator (rank 0) makes the temporary directory in ``prepare_global_plan`` and names
it, and every parameter's optimizer state index, in each rank's plan; each rank writes its part
(``rank-<r>/``: its chunks, checksummed as written, its manifest with their digests) in
``write_data``; every rank's small state (DCP writes each replicated value on one rank) travels
to the coordinator with the write results, and ``finish`` writes it with the coordinator's
part, then the top manifest and the index, and publishes the directory and ``latest``
atomically. Its mode is ``"dcp"``: ``gockpt.load`` loads it through DCP's planner.
"""

from __future__ import annotations

import glob
import io
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..core.digest import as_pairs, digests, to_hex
from ..core.errors import ConfigError, GockptError
from . import index as index_mod
from .commit import apply_retention, check_step_name
from .dcp_uploads import Uploads
from .format import DTYPE_TO_CODE, TMP_PREFIX, check_name
from .refs import TensorRef
from .schema import (WRITTEN_BY_DCP, Manifest, ModelSection, OptimizerSection, PartsManifest, SmallSection,
                     optim_tensor, param_tensor, part_name)
from .writer import CheckpointWriter

_STATE, _GROUPS = "optimizer.state.", "optimizer.param_groups."


@dataclass
class _Shared:
    """What the coordinator names in every rank's plan."""

    tmp: str  # the checkpoint's temporary directory (several ranks: the parts go in it)
    world: int
    owners: Dict[str, int]  # parameter -> its optimizer state index, alike on every rank
    flat: bool = False  # no model. / optimizer. name: every tensor is the model's (its state dict)


@dataclass
class _Part:
    """One rank's share of the checkpoint, as ``write_data`` sorts its items."""

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)  # stored name -> data
    params: Dict[str, TensorRef] = field(default_factory=dict)
    slices: Dict[str, dict] = field(default_factory=dict)
    aligned: Dict[int, Dict[str, TensorRef]] = field(default_factory=dict)
    entries: Dict[str, list] = field(default_factory=dict)  # this rank's index entries
    small: dict = field(default_factory=dict)  # what travels to the coordinator

    def slice_of(self, param: str, item, t: torch.Tensor) -> None:
        """Record where ``t``, the chunk of ``item``, lies in ``param``'s global tensor
        (optimizer state lies as its parameter does)."""
        td = item.tensor_data
        where = {"shape": list(td.size), "offsets": list(td.chunk.offsets)}
        known = self.slices.setdefault(param, where)
        if known != where or list(td.chunk.sizes) != list(t.shape):
            raise GockptError(f"GockptWriter: {item.index.fqn!r} is not sliced as its "
                              f"parameter {param!r} on this rank ({where} against {known}): "
                              "gockpt stores optimizer state beside its parameter's chunk")
        if param not in self.entries:
            code = DTYPE_TO_CODE[t.dtype]
            self.entries[param] = [list(td.size), code, ["slice", list(td.chunk.offsets),
                                                         list(t.shape), None, []]]


class GockptWriter(StorageWriter):
    """``torch.distributed.checkpoint.StorageWriter`` that writes gockpt's format.

    ``GockptWriter(run_dir, step=N)`` writes the checkpoint ``step-<N, 9 digits>`` of the run
    directory ``run_dir``; or ``dcp.save(state, checkpoint_id="run_dir/step-100",
    storage_writer=GockptWriter())``: the checkpoint ``step-100`` of ``run_dir``, its step the
    number its name ends in. ``keep_last``: committed checkpoints kept (older ones deleted
    after a commit). ``threads`` / ``direct`` / ``chunk_bytes``: as
    :class:`~gockpt.storage.writer.CheckpointWriter` takes them. ``remote`` (``s3://...``),
    ``remote_options`` / ``_keep_last`` / ``_wait_s``: each checkpoint also uploaded there in
    the background, as ``Config``'s fields say (:mod:`gockpt.storage.dcp_uploads`)."""

    def __init__(self, path: Optional[str | os.PathLike] = None, *, step: Optional[int] = None,
                 keep_last: Optional[int] = None, threads: Optional[int] = None,
                 direct: Optional[bool] = None, chunk_bytes: Optional[int] = None,
                 remote: Optional[str] = None, remote_options=None,
                 remote_keep_last: Optional[int] = None, remote_wait_s: Optional[float] = None):
        super().__init__()
        self.uploads = Uploads.of(remote, remote_options, remote_keep_last, remote_wait_s)
        if step is not None and (type(step) is not int or step < 0):
            raise ConfigError(f"GockptWriter: step must be an int >= 0, got {step!r}")
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ConfigError(f"GockptWriter: keep_last must be None or an int >= 1, got "
                              f"{keep_last!r}")
        self.root = None if path is None else os.fspath(path)
        self.step, self.name = step, None if step is None else f"step-{step:09d}"
        self.keep_last = keep_last
        self.options = dict(threads=threads, direct=direct, chunk_bytes=chunk_bytes)
        self.is_coordinator, self.rank = True, 0
        self._top: Optional[CheckpointWriter] = None  # the coordinator's
        self._mine: Optional[tuple] = None  # the coordinator's own part: (writer, _Part)
        self._owners: Dict[str, int] = {}  # parameter -> optimizer state index
        self.path: Optional[str] = None  # the committed checkpoint, after finish()

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            path = os.path.abspath(os.fspath(checkpoint_id))
            self.root, self.name = os.path.dirname(path), os.path.basename(path)
            found = re.search(r"(\d+)$", self.name)
            if found is None:
                raise ConfigError(f"GockptWriter: checkpoint_id {os.fspath(checkpoint_id)!r} "
                                  "must end in its step number (e.g. run1/step-100)")
            self.step = int(found.group(1))
        self._top, self._mine, self.path = None, None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return re.search(r"\d$", os.fspath(checkpoint_id)) is not None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        dist = torch.distributed
        self.rank = kwargs.get("rank", dist.get_rank() if dist.is_available()
                               and dist.is_initialized() else 0)
        if self.root is None or self.name is None:
            raise ConfigError("GockptWriter: no checkpoint to write: give GockptWriter(run_dir, "
                              "step=N), or dcp.save(..., checkpoint_id='run_dir/step-N')")
        check_name(self.name)
        if kwargs.get("use_collectives") is False and dist.is_available() and \
                dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError("GockptWriter: dcp.save(use_collectives=False) writes each rank "
                              "alone; gockpt's ranks commit one checkpoint together")
        if is_coordinator != (self.rank == 0):
            raise ConfigError("GockptWriter: DCP's coordinator must be rank 0 (its part holds "
                              "the checkpoint's small state)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # what this rank can write, before DCP's planner keeps each replicated item on one
        # rank only: the coordinator may then hand it an item that goes with its parameter
        return replace(plan, storage_data=tuple(item.index for item in plan.items))

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        if not all(getattr(p, "usable", True) for p in plans):
            raise ConfigError("GockptWriter: DCP's plan caching (enable_plan_caching=True) "
                              "hands back an earlier save's plan; use a planner without it")
        check_step_name(self.root, self.name)  # (only a killed job's, beyond latest, replaced)
        for stale in glob.glob(os.path.join(glob.escape(self.root),
                                            f"{TMP_PREFIX}{self.name}-*")):
            shutil.rmtree(stale, ignore_errors=True)  # an earlier save of it that failed
        self._top = CheckpointWriter(self.root, self.name, **self.options)
        local = [p.storage_data if isinstance(p.storage_data, tuple) else () for p in plans]
        fqns = [index.fqn for had in local for index in had]  # (the state dict's order)
        per_group = {f[len(_GROUPS):-len(".params")] for f in fqns
                     if f.startswith(_GROUPS) and f.endswith(".params")}  # (lists of names)
        known = {f[len("model."):] for f in fqns if f.startswith("model.")} | {
            f[len(_GROUPS):].rsplit(".", 1)[0] for f in fqns if f.startswith(_GROUPS)} - per_group
        owners: Dict[str, int] = {}
        for fqn in fqns:
            param = _owner(fqn, known)
            if param is not None and param not in owners:
                owners[param] = len(owners)
        self._owners = owners
        flat = not any(f.startswith(("model.", "optimizer.")) for f in fqns)
        shared = _Shared(self._top.tmp_path, len(plans), owners, flat)
        return _with_their_parameters(plans, [frozenset(had) for had in local], shared)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        shared: _Shared = plan.storage_data
        part = _Part()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                _add_value(part, item.index.fqn, _object_of(planner, item))
            else:
                t = planner.resolve_data(item).detach()
                _add_tensor(part, shared, item, t.to("cpu").contiguous())
        one = shared.world == 1
        writer = self._top if one else CheckpointWriter(shared.tmp, part_name(self.rank),
                                                        **self.options)
        try:
            writer.write_tensors(part.tensors)
            if self.rank == 0:  # committed in finish(), with every rank's small state
                self._mine = (writer, part)
            else:
                writer.commit(_manifest(part, self, shared.world, shared.owners,
                                        {}).to_json(), update_latest=False)
        except BaseException:
            writer.abort()
            raise
        nbytes = sum(t.numel() * t.element_size() for t in part.tensors.values())
        results = [WriteResult(item.index, 0, None) for item in plan.items]
        if results:  # (what the coordinator needs of this rank rides on the first result)
            results[0] = WriteResult(results[0].index, nbytes, (part.entries, part.small))
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        writer, part = self._mine
        payloads = [r[0].storage_data if r and isinstance(r[0].storage_data, tuple)
                    else ({}, {}) for r in results]
        small: dict = {}
        for _, theirs in payloads:  # (DCP wrote each replicated value on one rank)
            for key, values in theirs.items():
                into = small.setdefault(key, {})
                for k, v in values.items():
                    if key == "extra":
                        into[k] = v
                    else:  # state: index -> key -> value; groups: where -> key -> value
                        into.setdefault(k, {}).update(v)
        for settings in small.get("groups", {}).values():  # (parameters without state too)
            for param in settings.get("params", ()) if isinstance(settings, dict) else ():
                self._owners.setdefault(param, len(self._owners))
        try:
            mine = _manifest(part, self, len(results), self._owners, small)
            if len(results) == 1:
                self.path = writer.commit(mine.to_json())
            else:
                writer.commit(mine.to_json(), update_latest=False)
                top = PartsManifest(self.step, self.step, WRITTEN_BY_DCP, 1,
                                    [part_name(r) for r in range(len(results))],
                                    index=index_mod.merge([e for e, _ in payloads]))
                self.path = self._top.commit(top.to_json())
        except BaseException:
            self._top.abort()
            raise
        apply_retention(self.root, self.keep_last)
        if self.uploads is not None:
            self.uploads.submit(self.root, self.name)


def _role(item, shared: _Shared) -> tuple:
    """What a write item is: ``("param", name)``, ``("state", parameter, key)`` (aligned
    optimizer state), ``("scalar", parameter, key)`` (its 0-dim state: Adam's step) or
    ``("small",)`` (another value of the small state)."""
    fqn = item.index.fqn
    dim = len(item.tensor_data.size) if item.tensor_data is not None else None
    if dim is None:
        return ("small",)
    if shared.flat:
        return ("param", fqn)  # (a model's own state dict: 0-dim buffers too)
    owner = _owner(fqn, shared.owners) if fqn.startswith(_STATE) else None
    if owner is not None:
        return ("state" if dim else "scalar", owner, fqn[len(_STATE) + len(owner) + 1:])
    if fqn.startswith("model."):
        return ("param", fqn[len("model."):])
    return ("small",) if dim == 0 or fqn.startswith("optimizer.") else ("param", fqn)


def _with_their_parameters(plans: List[SavePlan], had: List[frozenset],
                           shared: _Shared) -> List[SavePlan]:
    """``plans`` with each chunk of optimizer state written by the rank that writes the same
    chunk of its parameter, where that rank holds it too (DCP's planner keeps a replicated
    item on the least loaded rank: a parameter and its moments could land in two parts;
    gockpt's parts keep them together). ``had``: the items each rank planned before."""
    roles = [[_role(item, shared) for item in plan.items] for plan in plans]
    home = {}  # (parameter, chunk offsets) -> the rank writing that chunk of it
    for rank, plan in enumerate(plans):
        for item, role in zip(plan.items, roles[rank]):
            if role[0] == "param":
                home[(role[1], tuple(item.tensor_data.chunk.offsets))] = rank
    items: List[list] = [[] for _ in plans]
    for rank, plan in enumerate(plans):
        for item, role in zip(plan.items, roles[rank]):
            to = home.get((role[1], tuple(item.tensor_data.chunk.offsets)), rank) \
                if role[0] == "state" else rank
            items[to if item.index in had[to] else rank].append(item)
    return [replace(plan, items=mine, storage_data=shared) for plan, mine in zip(plans, items)]


def _owner(fqn: str, known) -> Optional[str]:
    """The parameter whose optimizer state or settings ``fqn`` names (None: neither): the
    longest of the ``known`` parameter names it continues, else all but its last part (a
    parameter's state keys have no dots of their own)."""
    for prefix in (_STATE, _GROUPS):
        if fqn.startswith(prefix) and "." in fqn[len(prefix):]:
            rest = fqn[len(prefix):]
            within = [p for p in known if rest.startswith(p + ".")]
            param = max(within, key=len) if within else rest.rsplit(".", 1)[0]
            return None if prefix == _GROUPS and param.isdigit() and param not in known \
                else param
    return None


def _add_tensor(part: _Part, shared: _Shared, item, t: torch.Tensor) -> None:
    """A tensor item: a parameter's chunk, its optimizer state's, or a small value."""
    role = _role(item, shared)
    if role[0] == "scalar":
        part.small.setdefault("state", {}).setdefault(shared.owners[role[1]], {})[role[2]] = t
        return
    if role[0] == "small":
        _add_value(part, item.index.fqn, t)
        return
    part.slice_of(role[1], item, t)
    if role[0] == "state":
        idx = shared.owners[role[1]]
        name = optim_tensor(idx, role[2])
        part.aligned.setdefault(idx, {})[role[2]] = TensorRef(name)
    else:
        name = param_tensor(role[1])
        part.params[role[1]] = TensorRef(name)
    part.tensors[name] = t


def _add_value(part: _Part, fqn: str, value) -> None:
    """A small value: a param group's setting, or the extra state under its DCP name."""
    if fqn.startswith(_GROUPS) and "." in fqn[len(_GROUPS):]:
        where, key = fqn[len(_GROUPS):].rsplit(".", 1)  # (a setting's name has no dot)
        part.small.setdefault("groups", {}).setdefault(where, {})[key] = value
    else:
        part.small.setdefault("extra", {})[fqn] = value


def _object_of(planner: SavePlanner, item):
    """The value of a bytes item, as the state dict holds it (never unpickled: the planner's
    own object, which DCP's default planner keeps)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise GockptError(f"GockptWriter: {item.index.fqn!r} is not a tensor and the planner "
                          f"{type(planner).__name__} cannot hand its value over unpickled "
                          "(gockpt stores no pickles): use DCP's DefaultSavePlanner")
    value = lookup(item.index)
    if isinstance(value, io.BytesIO):
        raise GockptError(f"GockptWriter: {item.index.fqn!r} is a bytes stream; gockpt stores "
                          "no pickles: keep it as a tensor or plain values")
    return value


def _groups(owners: Dict[str, int], settings: Dict[str, dict]) -> list:
    """The param groups (``optimizer.state_dict()``'s: ``params`` as state indices) from the
    settings DCP saved: per parameter (flattened: parameters with the same settings form a
    group) or per group (``params`` as parameter names)."""
    groups: List[dict] = []
    by_group = sorted((int(w), s) for w, s in settings.items() if w.isdigit() and "params" in s)
    if by_group:
        for _, s in by_group:
            groups.append({**{k: v for k, v in s.items() if k != "params"},
                           "params": [owners[p] for p in s["params"] if p in owners]})
        return groups
    alike: Dict[str, dict] = {}
    for param in sorted(owners, key=owners.get):
        s = settings.get(param)
        if s is None:
            continue
        key = repr(sorted(s.items()))
        if key not in alike:
            alike[key] = {**s, "params": []}
            groups.append(alike[key])
        alike[key]["params"].append(owners[param])
    return groups


def _manifest(part: _Part, writer: GockptWriter, world: int, owners: Dict[str, int],
              small: dict) -> Manifest:
    """This rank's manifest (``small``: every rank's small state, on the coordinator)."""
    names = list(part.tensors)
    digest = dict(zip(names, map(to_hex, as_pairs(digests([part.tensors[n] for n in names])))))
    values = {"model": {}, "optimizer": None, "scheduler": None, "rng": None,
              "extra_state": small.get("extra") or None}
    if small.get("state") or small.get("groups"):
        values["optimizer"] = {"state": small.get("state", {}), "columns": {},
                               "param_groups": _groups(owners, small.get("groups", {}))}
    try:
        encoded, stored = SmallSection.encode(values)
    except (TypeError, ValueError) as exc:
        raise GockptError(f"GockptWriter: cannot store the state without pickle: {exc}") from exc
    if stored:  # (0-dim tensors are inline; larger ones are stored as parameters are)
        raise GockptError(f"GockptWriter: a value holds tensors inside a list "
                          f"({sorted(stored)[0]}): keep tensors in dicts, which DCP flattens")
    optimizer = None
    if part.aligned or values["optimizer"] is not None:
        optimizer = OptimizerSection(
            "", part.aligned, {idx: {k: digest[r.tensor] for k, r in refs.items()}
                               for idx, refs in part.aligned.items()},
            {idx: p for p, idx in owners.items() if idx in part.aligned or small})
    model = ModelSection(part.params, digests={n: digest[r.tensor]
                                               for n, r in part.params.items()},
                         slices=part.slices)
    return Manifest(writer.step, writer.step, WRITTEN_BY_DCP, 1, model, encoded, optimizer,
                    rank=writer.rank, world_size=world)
