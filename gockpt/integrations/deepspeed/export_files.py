"""The files of ``gockpt export --to deepspeed``: each rank's part of the gockpt checkpoint
read (:class:`Part`), the flat fp32 groups rebuilt from every rank's fragments, and what
DeepSpeed's ``engine.save_checkpoint`` writes for them (see
:mod:`gockpt.integrations.deepspeed.export`)."""

from __future__ import annotations

import math
import os
import re
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from ... import storage
from ...core.errors import ConfigError, CorruptCheckpointError
from ...loading import check_digests
from ...storage import shares
from ...storage.manifest import parse as parse_manifest
from ...storage.schema import Manifest
from ...storage.statedict import model_state, optimizer_state
from .export_config import BF16, UNFUSED, ZERO, Settings, one_line

MASTER = re.compile(r"master_g(\d+)_p(\d+)")  # state.EngineState's names
RECORD = ("fp32_layout", "counters", "scalers", "client_state")  # state.engine_record's
# (and "ds_config"/"ds_config_dropped" since gockpt recorded the config; optional here)


@dataclass
class Part:
    """One rank's part of the gockpt checkpoint, read."""

    path: str
    m: Manifest
    tensors: dict
    record: dict
    masters: Dict[Tuple[int, int], torch.Tensor] = field(default_factory=dict)


@dataclass
class Group:
    """One param group of the flat fp32 master: its parameters in flat order and where."""

    names: List[str]
    shapes: List[List[int]]
    offsets: List[int]
    partition: int  # elements per rank


def deepspeed_classes():
    """DeepSpeed's classes that its checkpoint pickles, and its version."""
    try:
        import deepspeed
        from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as exc:
        raise ConfigError("--to deepspeed needs DeepSpeed installed: its checkpoint pickles "
                         f"DeepSpeed's own objects (loss scaler, ZeRO stage) ({one_line(exc)})"
                         ) from None

    return types.SimpleNamespace(version=deepspeed.__version__, CreateLossScaler=CreateLossScaler,
                                 ZeroStageEnum=ZeroStageEnum, fragment_address=fragment_address)


def read_parts(sources) -> List[Part]:
    """Every rank's part, read: ``sources`` are (path, manifest data) in rank order. Replicas
    that wrote their state in shares (ZeRO 0: all of it; ZeRO 1/2: the module's weights) are
    put together once (every part's digests checked) and each part sees them whole."""
    together = None
    if len(sources) > 1:
        together = shares.read_together(os.path.dirname(os.path.abspath(sources[0][0])),
                                        verify=True, check=check_digests)
    parts = []
    for rank, (path, data) in enumerate(sources):
        if together is None:
            m = parse_manifest(path, data)
            tensors = storage.read_tensors(path, m, verify=True)
        else:
            m, tensors = together[rank]
        parts.append(_part(path, m, tensors))
    return parts


def _part(path: str, m: Manifest, tensors: dict) -> Part:
    try:
        record = m.small.decode("extra_state", tensors)
    except (KeyError, TypeError, ValueError):
        record = None
    if not isinstance(record, dict) or any(k not in record for k in RECORD):
        raise CorruptCheckpointError(f"{path}: no DeepSpeed engine state; gockpt export "
                                     "--to deepspeed / fp32 exports checkpoints written "
                                     "through gockpt.integrations.deepspeed (--to "
                                     "safetensors exports others)")
    if m.optimizer is None:
        raise CorruptCheckpointError(f"{path}: no optimizer section")
    part = Part(path, m, tensors, record)
    for name, ref in m.model.params.items():
        hit = MASTER.fullmatch(name)
        if hit:
            part.masters[int(hit[1]), int(hit[2])] = ref.resolve(tensors)
    if not part.masters:
        raise CorruptCheckpointError(f"{path}: no fp32 master tensors (master_g<G>_p<P>)")
    return part


def module_dtypes(part: Part) -> set:
    """The dtypes of the checkpoint's floating-point module weights."""
    return {t.dtype for n, ref in part.m.model.params.items() if n.startswith("module.")
            for t in [ref.resolve(part.tensors)] if t.is_floating_point()}


def groups_of(parts: List[Part]) -> List[Group]:
    """Every param group's parameters in flat order, from each rank's fragments (ZeRO)."""
    found: Dict[int, Dict[str, list]] = {}
    sizes: Dict[int, int] = {}
    for r, part in enumerate(parts):
        for name, entry in part.record["fp32_layout"].items():
            try:
                g, hp, lp, numel, shape = entry
                size = part.masters[g, 0].numel()
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpointError(f"{part.path}: fp32_layout entry {name!r} is malformed "
                                    f"or its master tensor is missing") from None
            if sizes.setdefault(g, size) != size:
                raise CorruptCheckpointError(f"{part.path}: group {g}'s partition has {size} elements, "
                                    f"rank 0's {sizes[g]}")
            p = found.setdefault(g, {}).setdefault(name, [list(shape), r * size + hp - lp, 0])
            if p[1] != r * size + hp - lp:
                raise CorruptCheckpointError(f"{part.path}: parameter {name!r} placed at two offsets")
            p[2] += numel
    if sorted(found) != list(range(len(found))):
        raise CorruptCheckpointError(f"{parts[0].path}: param groups {sorted(found)} in fp32_layout")
    groups = []
    for g in range(len(found)):
        params = sorted(found[g].items(), key=lambda kv: kv[1][1])
        for name, (shape, _off, covered) in params:
            if covered != math.prod(shape):
                raise CorruptCheckpointError(f"parameter {name!r}: the parts cover {covered} of its "
                                    f"{math.prod(shape)} elements; a part is missing")
        groups.append(Group([n for n, _ in params], [p[0] for _, p in params],
                            [p[1] for _, p in params], sizes[g]))
    return groups


def model_states_of(part: Part, optimized: set, s: Settings, kind: str, world: int, ds) -> dict:
    """What DeepSpeed's ``engine._save_checkpoint`` writes (dp rank 0's file); ``optimized``:
    the parameters some rank's fp32 master holds (the others are frozen)."""

    sd, aliases = model_state(part.path, part.m, part.tensors)
    module, copies = OrderedDict(), {}
    for name, value in sd.items():
        if name.startswith("module."):
            canon = aliases.get(name, name)  # tied names: one tensor, as module.state_dict()
            if canon not in copies:
                copies[canon] = own(sd[canon]) if torch.is_tensor(sd[canon]) else sd[canon]
            module[name[len("module."):]] = copies[canon]
    buffers = [n[len("module."):] for n in small_value(part, "model") if n.startswith("module.")]
    frozen = [n[len("module."):] for n in part.m.model.params
              if n.startswith("module.") and n[len("module."):] not in optimized]
    zero = kind in (ZERO, BF16)
    frozen_too = s.stage == 2  # DeepSpeed keeps frozen parameters' shapes under ZeRO 2
    counters = part.record["counters"]
    client = part.record["client_state"]
    if client is None:
        client = {}
    if not isinstance(client, dict):
        raise CorruptCheckpointError(f"{part.path}: client_state is a {type(client).__name__}, "
                            "DeepSpeed stores a dict")
    state = dict(
        module=module,
        buffer_names=buffers,
        optimizer=None,
        param_shapes=None,
        frozen_param_shapes=OrderedDict((n, module[n].shape) for n in frozen)
        if frozen_too else None,
        shared_params={a[len("module."):]: c[len("module."):] for a, c in aliases.items()
                       if a.startswith("module.")} if zero else None,
        frozen_param_fragments=OrderedDict((n, module[n]) for n in frozen) if frozen_too else None,
        lr_scheduler=small_value(part, "scheduler"),
        data_sampler=None,
        random_ltd=None,
        skipped_steps=counters["skipped_steps"],
        global_steps=counters["global_steps"],
        global_samples=counters["global_samples"],
        dp_world_size=world,
        mp_world_size=1,
        checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
        ds_config=s.config,
        ds_version=ds.version)
    state.update(client)  # as DeepSpeed does: client keys at the top level
    return state


def stage0_optimizer(part: Part, s: Settings, kind: str) -> dict:
    """FP16_Optimizer's (or FP16_UnfusedOptimizer's) ``state_dict()``, bf16 or fp16."""
    lsc = part.record["scalers"]["loss_scale_config"]
    out = {}
    try:
        if kind == UNFUSED or lsc["use_grad_scaling"]:
            out.update(dynamic_loss_scale=lsc["dynamic_loss_scale"], cur_scale=lsc["cur_scale"],
                       cur_iter=lsc["cur_iter"])
            if lsc["dynamic_loss_scale"]:
                out.update({k: lsc[k] for k in ("last_overflow_iter", "scale_factor",
                                                "scale_window")})
    except KeyError as exc:
        raise CorruptCheckpointError(f"{part.path}: the loss scaling record lacks {exc}") from None
    out["optimizer_state_dict"] = base_state(part)
    groups = sorted({g for g, _ in part.masters})
    if kind == UNFUSED:  # one fp32 master per parameter
        out["fp32_groups"] = [[own(part.masters[g, p]) for p in
                               sorted(p for gg, p in part.masters if gg == g)] for g in groups]
    else:
        out["fp32_groups_flat"] = [own(part.masters[g, 0]) for g in groups]
        out["clip_grad"] = s.clip
    return out


def zero_optimizer(part: Part, rank: int, groups: List[Group], s: Settings, kind: str,
                    world: int, ds) -> dict:
    """DeepSpeedZeroOptimizer's (or BF16_Optimizer's) ``state_dict()`` of ``rank``."""
    paddings, param_paddings, partitions, mappings = [], [], [], []
    for g, group in enumerate(groups):
        numels = [math.prod(sh) for sh in group.shapes]
        ends = [o + n for o, n in zip(group.offsets, numels)]
        param_paddings.append([nxt - end for end, nxt in zip(ends, group.offsets[1:])] + [0])
        size, left = group.partition, rank * group.partition
        if kind == BF16:  # BF16_Optimizer: the tail, on the last rank
            padding = size * world - sum(numels) if rank == world - 1 else 0
        else:  # ZeRO's: whatever of this rank's partition lies past the last parameter
            padding = min(size, max(0, left + size - ends[-1]))
        paddings.append(padding)
        master = part.masters[g, 0]
        partitions.append(own(master if kind == BF16 else master[:size - padding]))
        layout = part.record["fp32_layout"]
        mappings.append(OrderedDict((n, ds.fragment_address(numel=layout[n][3], start=layout[n][1]))
                                    for n in group.names if n in layout and layout[n][0] == g))
    if any(any(p < 0 for p in pp) for pp in param_paddings):
        raise CorruptCheckpointError(f"{part.path}: parameters overlap in the fp32 layout")
    osd = {}
    if kind == ZERO:
        scaler, overflow = loss_scaler(part, s, ds)
        osd.update(loss_scaler=scaler, dynamic_loss_scale=scaler.dynamic, overflow=overflow)
    osd["clip_grad"] = s.clip
    osd["base_optimizer_state"] = base_state(part)
    osd["single_partition_of_fp32_groups"] = partitions
    if kind == ZERO:
        osd["zero_stage"] = ds.ZeroStageEnum(s.stage)
    osd["group_paddings"] = paddings
    if kind == ZERO:
        osd["param_alignment_paddings"] = param_paddings
    osd["partition_count"] = [world] * len(groups)
    osd["ds_version"] = ds.version
    osd["param_slice_mappings"] = mappings
    return osd


def loss_scaler(part: Part, s: Settings, ds) -> tuple:
    """(ZeRO's loss scaler as DeepSpeed builds it, with the recorded state; overflow flag)."""
    n = part.record["scalers"]["loss_scaler"]
    try:
        dynamic = bool(n["dynamic"])
        args = {k: n[k] for k in ("scale_window", "min_scale", "delayed_shift",
                                  "consecutive_hysteresis")} if dynamic else None
        if dynamic:
            args["init_scale"] = n["cur_scale"]
        scaler = ds.CreateLossScaler(dtype=s.dtype, static_loss_scale=n["cur_scale"],
                                     dynamic_scaling=dynamic, dynamic_loss_args=args)
    except KeyError as exc:
        raise CorruptCheckpointError(f"{part.path}: the loss scaler record lacks {exc}") from None
    for key, value in n.items():
        setattr(scaler, key, value)
    # A dynamic scaler marks an overflow at iteration i by last_overflow_iter = i, then counts i.
    overflow = dynamic and n.get("last_overflow_iter") == n.get("cur_iter", 0) - 1
    return scaler, overflow


def base_state(part: Part) -> dict:
    """The base optimizer's ``state_dict()`` (its state in index order, own storage)."""

    osd = optimizer_state(part.path, part.m, part.tensors)
    osd["state"] = {i: {k: own(v) if torch.is_tensor(v) else v for k, v in st.items()}
                    for i, st in osd["state"].items()}
    return osd


def small_value(part: Part, section: str):
    """A small-state section's value (the scheduler's is None without a scheduler)."""
    try:
        return part.m.small.decode(section, part.tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{part.path}: the small state {section!r} is unreadable "
                            f"({one_line(exc)})") from None


def own(t: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own (a stored tensor may be a view into a packed one, and
    ``torch.save`` writes a view's whole storage)."""
    return t.clone()
