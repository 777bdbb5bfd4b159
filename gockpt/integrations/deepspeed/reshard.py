"""Loading a DeepSpeed ZeRO 1/2 checkpoint at another data-parallel degree -- with the same
stage or the other one -- through the patched ``engine.load_checkpoint``. (At the same
degree, stages 1 and 2 cut their partitions alike: the ordinary load takes them.)

ZeRO keeps each parameter group's fp32 master (and the base optimizer's moments, shaped like
it) as one flat tensor cut into one partition per rank, padded for the degree: saved on N
ranks, rank s holds elements [s x P_N, (s + 1) x P_N) of the group's flat tensor, which DCP's
metadata of the checkpoint (:class:`gockpt.storage.dcp.GockptReader`) shows as
``model.master_g{g}_p0`` of N x P_N elements. Where each parameter lies in it is what every
part's engine record says (``fp32_layout``: a fragment of the parameter at a start in the
rank's partition), so a parameter's elements sit contiguously at one offset of the saved flat
tensor. This rank's live fragments (``fp32_layout`` of the engine on M ranks) are those
element ranges of the saved flat tensors; DCP's overlap computation
(``create_read_items_for_chunk_list``) turns them into reads of the saved partitions, and the
reader reads only their byte ranges (whole checksum chunks, each verified) straight into the
live partition and moments: about 1/M of the stored fp32 state per rank. The module's weights
(every rank's alike, stored in shares) are read whole.

Everything is checked first -- the same parameters in the same groups with the same shapes,
each saved parameter's fragments covering it once and in one run, the optimizer's moments,
the loss scaling -- so a refusal leaves the engine untouched; a piece that does not read back
intact on one rank fails the load on every rank (the ranks agree by one all-reduce). Step
counters, hyperparameters, engine counters, loss scaling, the scheduler and ``client_state``
come from rank 0's part; RNG states are per rank and not restored (a warning says so).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List, Tuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ... import storage
from ...core.errors import CorruptCheckpointError, LoadError
from ...replay.adapters import state_keys_of
from ...resharding import any_rank, check_model
from ...restored import (Restored, apply_rest, decode_rest, partly_overwritten, restoring,
                         warn_rng_not_restored)
from ...storage import manifest as manifest_mod
from ...storage.dcp import GockptReader
from ...storage.schema import Manifest, is_small_tensor
from ...storage.statedict import optimizer_state_dict
from .state import (EngineState, base_optimizer, fp32_layout, parallel_options,
                    partitioned_groups)

log = logging.getLogger("gockpt")


def needs_resharding(top: str, engine, written: int, world: int) -> bool:
    """Whether the checkpoint at ``top`` (saved on ``written`` ranks) holds ZeRO partitions
    cut for another degree than the engine's on ``world`` ranks: on either side the fp32
    masters are slices of the flat groups (``Config.global_slices``) and the degrees differ."""
    if written == world:
        return False
    _, m = manifest_mod.read(top, 0)
    saved_cut = any(name.startswith("master_") for name in m.model.slices)
    return saved_cut or "global_slices" in parallel_options(engine, EngineState(engine))


class _Into:
    """The small part of DCP's ``LoadPlanner`` that ``GockptReader.read_data`` calls: each
    read lands in a view of its destination (``destinations[fqn][i]``: the i-th local chunk
    asked of ``fqn``), in place."""

    def __init__(self, destinations: Dict[str, List[torch.Tensor]]):
        self.destinations = destinations

    def resolve_tensor(self, item) -> torch.Tensor:
        out = self.destinations[item.dest_index.fqn][item.dest_index.index]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            out = out.narrow(d, o, n)
        return out

    def commit_tensor(self, item, tensor) -> None:
        pass  # (resolve_tensor gave a view of the destination: written in place)


def load_at_another_degree(top: str, engine, *, with_optimizer: bool, scheduler,
                           written: int, world: int, check: Callable[[dict], None],
                           verify: bool = True) -> Tuple[Restored, dict]:
    """Load the checkpoint directory ``top`` (saved by ZeRO on ``written`` ranks) into
    ``engine`` on this job's ``world`` ranks (see the module's docstring); ``check(record)``
    raises if the engine cannot take rank 0's engine record (called before anything changes).
    A collective: every rank calls it. Returns what was restored
    (``extra_state``: rank 0's engine record, not yet put into the engine) and how many bytes
    this rank read: ``{"fp32": of the masters and moments, "fp32_stored": all ranks' stored,
    "module": of the module's weights}``."""
    path, m0 = manifest_mod.read(top, 0)
    small = storage.read_tensors(path, m0, [n for n in m0.tensors if is_small_tensor(n)],
                                 verify=verify)
    rest = decode_rest(path, m0, small, scheduler, with_rng=False)
    check(rest["extra_state"])
    records = [rest["extra_state"]] + [_record(top, s, verify) for s in range(1, written)]
    reader = GockptReader(top, verify=verify)
    md = reader.read_metadata().state_dict_metadata
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=False)

    state = EngineState(engine)
    module = {name[len("module."):]: t for name, t in state.state_dict().items()
              if name.startswith("module.")}  # the module's weights and buffers, whole
    check_model(top, md, module, prefix="model.module.")
    asked: Dict[str, List[Tuple[ChunkStorageMetadata, torch.Tensor]]] = {
        f"model.module.{name}": [(_whole(t), t)] for name, t in module.items()}
    opt_sd = None
    if with_optimizer:
        base = base_optimizer(engine)
        saved = _saved_runs(top, m0, md, records)
        masters = [p for g in base.param_groups for p in g["params"]]
        moments = {}
        for gi, group in enumerate(base.param_groups):
            name = f"master_g{gi}_p0"
            entry = md.get(f"model.{name}")
            if len(group["params"]) != 1 or entry is None or entry.properties.dtype != \
                    masters[gi].dtype:
                raise LoadError(f"{top}: param group {gi} of the optimizer is no ZeRO flat "
                                f"fp32 partition like the checkpoint's {name!r}")
            moments[gi] = _moment_targets(top, md, name, masters[gi], base)
        stepped = _groups_of(engine)  # every rank's parameters: every rank refuses alike
        for param in sorted(set(saved) | set(stepped)):
            if param not in stepped:
                raise LoadError(f"{top}: the checkpoint holds the fp32 master of {param!r}, "
                                "which the engine's optimizer does not step")
            if param not in saved:
                raise LoadError(f"{top}: the model's {param!r} has no fp32 master in the "
                                "checkpoint")
            if saved[param][0] != stepped[param]:
                raise LoadError(f"{top}: parameter {param!r} is in param group "
                                f"{saved[param][0]} in the checkpoint, in group "
                                f"{stepped[param]} in the engine")
        for param, (gi, start, first, numel, shape) in fp32_layout(engine).items():
            if numel == 0:
                continue  # (DeepSpeed maps no empty fragment; nothing to read for one)
            _, at, saved_shape = saved[param]
            if list(saved_shape) != list(shape):
                raise LoadError(f"{top}: parameter {param!r} has shape {list(saved_shape)} in "
                                f"the checkpoint but {list(shape)} in the model")
            chunk = ChunkStorageMetadata(torch.Size([at + first]), torch.Size([numel]))
            name = f"master_g{gi}_p0"
            asked.setdefault(f"model.{name}", []).append(
                (chunk, masters[gi].narrow(0, start, numel)))
            for key, t in moments[gi].items():
                asked.setdefault(f"optimizer.state.{name}.{key}", []).append(
                    (chunk, t.narrow(0, start, numel)))
        opt_sd = _optimizer_state(top, path, m0, small, base, reader.owners, moments)

    read = _read_on_every_rank(top, reader, md, asked)
    with restoring(top):
        if opt_sd is not None:
            base_optimizer(engine).load_state_dict(opt_sd)
        extra_state = apply_rest(rest, scheduler, None)
    warn_rng_not_restored(top, written, world)
    read["fp32_stored"] = sum(md[fqn].size.numel() * md[fqn].properties.dtype.itemsize
                              for fqn in asked if not fqn.startswith("model.module."))
    log.info("gockpt: %s saved by ZeRO on %d rank(s), loaded on %d: this rank read %d of the "
             "%d stored bytes of fp32 masters and moments", top, written, world, read["fp32"],
             read["fp32_stored"])
    return Restored(step=m0.step, extra_state=extra_state, path=top, manifest=m0,
                    rng_restored=False, resharded=True), read


def _read_on_every_rank(top: str, reader: GockptReader, md: dict, asked: dict) -> dict:
    """Read what this rank asked (``asked``: fqn -> [(chunk in the saved tensor, the live
    view it goes to)]) in place; returns the bytes read of each kind (``module``, ``fp32``).
    Every rank reads its own pieces, and one rank's failure (a checksum, a file) fails the
    load on every rank: the others would train on and wait for it in their first collective."""
    into = _Into({fqn: [t for _, t in wanted] for fqn, wanted in asked.items()})
    read = {"module": 0, "fp32": 0}  # (the reader's count)
    failure = None
    try:
        for kind in read:
            items = [item for fqn, wanted in asked.items()
                     if fqn.startswith("model.module.") == (kind == "module")
                     for item in create_read_items_for_chunk_list(
                         fqn, md[fqn], [c for c, _ in wanted])]
            before = reader.read_bytes
            reader.read_data(LoadPlan(items), into).wait()
            read[kind] = reader.read_bytes - before
    except Exception as exc:  # noqa: BLE001 -- raised below, once every rank knows
        failure = exc
    if any_rank(failure is not None):
        if isinstance(failure, CorruptCheckpointError):
            raise partly_overwritten(failure) from failure
        if failure is None:
            raise LoadError(f"{top}: another rank could not read its pieces of the checkpoint "
                            "(its error says why); this engine's weights and fp32 state may be "
                            "partly overwritten: load an intact checkpoint before training on")
        raise LoadError(f"{top}: cannot read this rank's pieces of the checkpoint: "
                        f"{type(failure).__name__}: {failure}; this engine's weights and fp32 "
                        "state may be partly overwritten") from failure
    return read


def _groups_of(engine) -> Dict[str, int]:
    """parameter name -> the group of the base optimizer that steps its fp32 master, for
    every parameter ZeRO partitions (on whichever rank its fragments lie)."""
    groups = partitioned_groups(engine)
    if groups is None:  # (not ZeRO 1/2: every parameter's whole master is this rank's)
        return {param: where[0] for param, where in fp32_layout(engine).items()}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {names[id(p)]: gi for gi, group in enumerate(groups) for p in group}


def _record(top: str, rank: int, verify: bool) -> dict:
    """The engine record of rank ``rank``'s part (its ``fp32_layout``)."""
    path, m = manifest_mod.read(top, rank)
    small = storage.read_tensors(path, m, [n for n in m.tensors if is_small_tensor(n)],
                                 verify=verify)
    return decode_rest(path, m, small, None, with_rng=False)["extra_state"]


def _saved_runs(top: str, m0: Manifest, md: dict, records: List[dict]) -> Dict[str, tuple]:
    """parameter -> (group, its first element's offset in the saved flat group, shape), from
    every part's ``fp32_layout``; CorruptCheckpointError unless each parameter's fragments
    lie in one run at one offset of the flat group and cover it exactly once."""
    # rank s's partition of a cut group starts at s x its size (DeepSpeed pads the groups so
    # that every rank's is as large); an uncut one (ZeRO 0, one rank) is whole in each part
    sizes = {int(name[len("master_g"):-len("_p0")]): math.prod(m0.logical_shape(ref))
             for name, ref in m0.model.params.items()
             if name.startswith("master_g") and name.endswith("_p0")}
    cut = any(name.startswith("master_") for name in m0.model.slices)
    runs: Dict[str, tuple] = {}
    pieces: Dict[str, list] = {}
    for s, record in enumerate(records if cut else records[:1]):
        layout = record.get("fp32_layout") if isinstance(record, dict) else None
        if not isinstance(layout, dict):
            raise CorruptCheckpointError(f"{top}: rank {s}'s part has no fp32 layout (not a "
                                         "checkpoint of gockpt's DeepSpeed integration)")
        for param, (gi, start, first, numel, shape) in layout.items():
            at = s * sizes.get(gi, 0) + start - first
            flat = md.get(f"model.master_g{gi}_p0")
            if gi not in sizes or flat is None or start + numel > sizes[gi] or at < 0 or \
                    at + math.prod(shape) > flat.size.numel() or \
                    runs.setdefault(param, (gi, at, tuple(shape))) != (gi, at, tuple(shape)):
                raise CorruptCheckpointError(f"{top}: the fp32 fragments of {param!r} do not "
                                             "lie in one run of its flat group")
            pieces.setdefault(param, []).append((first, numel))
    for param, (_, _, shape) in runs.items():
        end = 0
        for first, numel in sorted(pieces[param]):
            if first != end:
                break
            end += numel
        if end != math.prod(shape) or sum(n for _, n in pieces[param]) != end:
            raise CorruptCheckpointError(f"{top}: the saved fp32 fragments of {param!r} do "
                                         f"not cover its {math.prod(shape)} elements once")
    return runs


def _moment_targets(top: str, md: dict, name: str, master: torch.Tensor, base) -> dict:
    """key -> a zeroed tensor like ``master`` for each per-element optimizer state the
    checkpoint holds of flat group ``name`` (the padding keeps zeros, as DeepSpeed's own)."""
    size = tuple(md[f"model.{name}"].size)
    keys = [k[len(f"optimizer.state.{name}."):] for k, e in md.items()
            if k.startswith(f"optimizer.state.{name}.") and hasattr(e, "size")
            and tuple(e.size) == size]
    missing = sorted(set(state_keys_of(base)) - set(keys))
    if missing:
        raise LoadError(f"{top}: the optimizer state of {name!r} lacks {missing}")
    for k in keys:
        dtype = md[f"optimizer.state.{name}.{k}"].properties.dtype
        if dtype != master.dtype:
            raise LoadError(f"{top}: optimizer state {k!r} of {name!r} is {dtype} in the "
                            f"checkpoint, the master is {master.dtype}")
    return {k: torch.zeros_like(master) for k in keys}


def _optimizer_state(top: str, path: str, m0: Manifest, small: dict, base, owners: dict,
                     moments: Dict[int, dict]) -> dict:
    """The base optimizer's state dict: rank 0's small state (step counters, param groups'
    hyperparameters) with the moments DCP fills (``moments``: group -> key -> tensor)."""
    saved = optimizer_state_dict(m0, path, small, base, aligned=False)
    index = {f"master_g{gi}_p0": gi for gi in range(len(base.param_groups))}
    state = {}
    for idx, values in saved["state"].items():
        gi = index.get(owners.get(idx))
        if gi is None:
            raise LoadError(f"{top}: optimizer state {idx} belongs to no flat group of the "
                            "engine's optimizer")
        state[gi] = {**{k: v for k, v in values.items() if k not in moments[gi]},
                     **moments[gi]}
    groups = [{**g, "params": [gi]} for gi, g in enumerate(saved["param_groups"])]
    return {"state": state, "param_groups": groups}


def _whole(t: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size([0] * t.dim()), t.shape)
