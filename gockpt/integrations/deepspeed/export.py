"""``gockpt export PATH --to deepspeed OUT_DIR [--ds-config CONFIG]``: a checkpoint written
through ``gockpt.integrations.deepspeed`` in DeepSpeed's own layout, for an engine without
gockpt: ``OUT_DIR/latest`` names ``global_step<N>/``, which holds what DeepSpeed's
``engine.save_checkpoint`` writes for the same world size and optimizer wrapper --
``mp_rank_00_model_states.pt`` (module weights, counters, LR scheduler, client state, and for
stage 0 the optimizer) and, under ZeRO 1/2, one
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank (the base optimizer's state
and fp32 master partition, loss scaler, paddings, fragment addresses).  A plain
``engine.load_checkpoint(OUT_DIR)`` continues from it exactly as from DeepSpeed's own
checkpoint of that step.

Everything comes from the gockpt checkpoint (read with gockpt's checksummed readers, never
unpickled), the DeepSpeed config included: DeepSpeed stores it (``ds_config``) and it decides
what the files hold -- the ZeRO stage (1 and 2 leave the same state, in other files), the
precision, the gradient clipping, fp32 gradient accumulation, optimizer offload.  The
integration records it at each save as DeepSpeed does (``engine.config``; see
``gockpt.integrations.deepspeed.state.ds_config_record``), without what it cannot store
without pickle (named in the record: a checkpoint whose recorded config lacks something that
decides the layout is refused without ``--ds-config``).

``--ds-config CONFIG`` (JSON) is optional.  Given, it is the config written as ``ds_config``,
and it must agree with the recorded one on what decides the layout (stage, precision,
clipping, fp32 accumulation, offload; anything else may differ) -- else a usage error naming
each difference.  Not given, the recorded config is used.  A checkpoint of an older gockpt
records none: then ``--ds-config`` is needed (the config the run trained with).  Either way
the config is checked against the checkpoint: its precision must be the module weights', and
the optimizer wrapper it builds the one gockpt recorded the loss scaling of
(``loss_scale_config``: stage 0's ``FP16_Optimizer``; ``loss_scaler``: ZeRO's
``DeepSpeedZeroOptimizer``; none: ``BF16_Optimizer``).  Written with DeepSpeed's own classes
(the loss scaler, ``ZeroStageEnum``, ``fragment_address`` are pickled as DeepSpeed pickles
them), so DeepSpeed must be installed.

Two things a gockpt checkpoint does not record.  The ZeRO optimizer's ``overflow`` flag
(whether step N itself overflowed): with a dynamic loss scaler (fp16) it follows from the
scaler's history; otherwise it is written False, which differs from DeepSpeed's only for a
checkpoint of a step bf16 skipped -- and DeepSpeed sets the flag again at the next step before
reading it.  The per-module state-dict versions that ``module.state_dict()`` attaches as
``_metadata``: the module's state dict goes without them, as one read from safetensors does
(it matters only to a module whose ``_load_from_state_dict`` converts an older version's keys).
Refused with the reason: ZeRO 3, fp32 training without an fp16/bf16 wrapper, and the ZeRO
options that change the file layout (``elastic_checkpoint``, ``round_robin_gradients``, NVMe
offload).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import stat
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ... import storage
from ...storage.commit import replace_file, write_latest
from ...storage.format import TMP_PREFIX, fsync_dir, fsync_path
from ...storage.manifest import parse as parse_manifest
from ...storage.schema import Manifest
from ...core.errors import ConfigError, CorruptCheckpointError
from ...storage.statedict import model_state, optimizer_state

MASTER = re.compile(r"master_g(\d+)_p(\d+)")  # state.EngineState's names
RECORD = ("fp32_layout", "counters", "scalers", "client_state")  # state.engine_record's
# (and "ds_config"/"ds_config_dropped" since gockpt recorded the config; optional here)
RECORDED = "the DeepSpeed config recorded in the checkpoint"
# The config's top-level keys that decide the export's layout (a recorded config that lost
# something under one of them cannot be used alone).
LAYOUT_KEYS = ("zero_optimization", "bf16", "bfloat16", "fp16", "gradient_clipping",
               "data_types")
FP32 = ("fp32", "float32", "float", "torch.float32")
# The optimizer wrappers DeepSpeed builds, by what gockpt recorded of their loss scaling.
STAGE0, ZERO, BF16 = "FP16_Optimizer", "DeepSpeedZeroOptimizer", "BF16_Optimizer"
UNFUSED = "FP16_UnfusedOptimizer"


@dataclass
class Settings:
    """What of the DeepSpeed config decides the checkpoint's layout."""

    config: dict
    source: str  # for messages: "--ds-config PATH" or RECORDED
    stage: int
    dtype: torch.dtype
    clip: float
    fp32_accumulation: bool
    offload: bool

    def differences(self, other: "Settings") -> List[str]:
        """What decides the layout and differs: 'what: mine (recorded: other's)'."""
        out = []
        for what, a, b in (
                ("zero_optimization.stage", self.stage, other.stage),
                ("precision", _dtype_name(self.dtype), _dtype_name(other.dtype)),
                ("gradient_clipping", self.clip, other.clip),
                ("fp32 gradient accumulation (data_types.grad_accum_dtype)",
                 self.fp32_accumulation, other.fp32_accumulation),
                ("optimizer offload", self.offload, other.offload)):
            if a != b:
                out.append(f"{what} {a} (recorded: {b})")
        return out


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


@dataclass
class Export:
    """The DeepSpeed checkpoint, in memory: file name -> object to ``torch.save``."""

    tag: str
    files: Dict[str, dict]
    kind: str
    stage: int
    world: int
    scripts: bool  # DeepSpeed copies zero_to_fp32.py beside a ZeRO checkpoint
    config_from: str = RECORDED  # where ds_config came from
    notes: List[str] = field(default_factory=list)


def build(sources, config_path: Optional[str] = None) -> Export:
    """``sources``: (path, manifest data) of every rank's part, in rank order; ``config_path``:
    ``--ds-config`` (None: the config recorded in the checkpoint)."""
    given = None
    if config_path is not None:  # before anything is read: a wrong config fails at once
        given = _settings(_load_config(config_path), f"--ds-config {config_path}")
    ds = _deepspeed()
    parts = [_read(path, data) for path, data in sources]
    s, notes = _choose(given, parts[0])
    _check_dtype(s, parts[0])
    kind = _kind(parts[0], s)
    world = len(parts)
    counters = parts[0].record["counters"]
    tag = f"global_step{counters['global_steps']}"
    optimized = set().union(*(p.record["fp32_layout"] for p in parts))  # every rank's
    model_states = _model_states(parts[0], optimized, s, kind, world, ds)
    files = {"mp_rank_00_model_states.pt": model_states}
    if kind in (ZERO, BF16):
        groups = _groups(parts)
        model_states["param_shapes"] = [
            OrderedDict((n, torch.Size(sh)) for n, sh in zip(g.names, g.shapes)) for g in groups]
        prefix = "bf16_" if s.dtype == torch.bfloat16 else ""
        for r, part in enumerate(parts):
            osd = _zero_optimizer(part, r, groups, s, kind, world, ds)
            files[f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = {
                "optimizer_state_dict": osd, "ds_config": s.config, "ds_version": ds.version}
    else:
        model_states["optimizer"] = _stage0_optimizer(parts[0], s, kind)
    return Export(tag, files, kind, s.stage, world, scripts=kind in (ZERO, BF16),
                  config_from=s.source, notes=notes)


def write(out: str, export: Export, force: bool) -> None:
    """Write ``export`` into ``out``: the tag directory complete under a temporary name, then
    renamed into place (replacing one of the same tag with ``force``), then ``latest``."""
    final = os.path.join(out, export.tag)
    if os.path.lexists(final) and not force:
        raise ConfigError(f"{final}: exists; pass --force to replace it")
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, f"{TMP_PREFIX}{export.tag}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)  # (not mkdtemp: its mode 0700 would stay on the renamed directory)
    try:
        for name, obj in export.files.items():
            f = os.path.join(tmp, name)
            torch.save(obj, f)
            fsync_path(f)
        fsync_dir(tmp)
        if os.path.isdir(final) and not os.path.islink(final):
            shutil.rmtree(final)  # --force
        elif os.path.lexists(final):
            os.unlink(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out)
    if export.scripts:  # as DeepSpeed's _save_zero_checkpoint does: recovery without DeepSpeed
        import deepspeed
        utils = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            src = os.path.join(utils, script)
            if os.path.isfile(src):
                dst = os.path.join(out, script)
                replace_file(dst, lambda t, src=src: shutil.copyfile(src, t))
                os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
    write_latest(out, export.tag)


# ---------------------------------------------------------------------------------- reading


def _deepspeed():
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


def _read(path: str, data: dict) -> Part:
    m = parse_manifest(path, data)
    tensors = storage.read_tensors(path, m, verify=True)
    try:
        record = m.small.decode("extra_state", tensors)
    except (KeyError, TypeError, ValueError):
        record = None
    if not isinstance(record, dict) or any(k not in record for k in RECORD):
        raise CorruptCheckpointError(f"{path}: no DeepSpeed engine state; --to deepspeed exports "
                            "checkpoints written through gockpt.integrations.deepspeed")
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


def _load_config(config_path: str) -> dict:
    """``--ds-config``'s JSON object."""
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--ds-config {config_path}: {one_line(exc)}") from None
    except ValueError as exc:
        raise ConfigError(f"--ds-config {config_path}: not JSON ({one_line(exc)})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--ds-config {config_path}: not a JSON object")
    return config


def _choose(given: Optional[Settings], part: Part) -> Tuple[Settings, List[str]]:
    """The settings to export with, and notes to print: ``--ds-config``'s (``given``) checked
    against the recorded config, or the recorded config's."""
    config = part.record.get("ds_config")
    dropped = part.record.get("ds_config_dropped") or []
    if not isinstance(config, dict):
        if given is not None:
            return given, []
        why = "was written by a gockpt that did not record it" if "ds_config" not in part.record \
            else f"could not be recorded ({_dropped_text(dropped)})"
        raise ConfigError(f"{part.path}: the DeepSpeed config {why}; pass --ds-config CONFIG, "
                         "the DeepSpeed config (JSON) the run trained with")
    lost = [d for d in dropped if isinstance(d, dict) and d.get("path")
            and d["path"][0] in LAYOUT_KEYS]
    if given is None and lost:
        raise ConfigError(f"{part.path}: {RECORDED} lacks what gockpt could not store of it "
                         f"({_dropped_text(lost)}), which decides the layout; pass --ds-config "
                         "CONFIG, the DeepSpeed config (JSON) the run trained with")
    if given is None:
        s = _settings(config, RECORDED)
        return s, [f"{RECORDED} lacks {_dropped_text(dropped)} (not storable without pickle); "
                   "ds_config is written without it"] if dropped else []
    if lost:
        return given, [f"--ds-config not checked against {RECORDED}: it lacks "
                       f"{_dropped_text(lost)}"]
    differences = given.differences(_settings(config, RECORDED))
    if differences:
        raise ConfigError(f"{given.source} disagrees with {RECORDED} on what decides the "
                         f"layout: {'; '.join(differences)}. Leave --ds-config out to export "
                         "with the recorded config")
    return given, []


def _dropped_text(dropped: list) -> str:
    def one(d):
        if not isinstance(d, dict):
            return repr(d)
        return f"{'.'.join(map(str, d.get('path') or [])) or 'the config'}: {d.get('type')}"
    return ", ".join(map(one, dropped[:5])) + (f" and {len(dropped) - 5} more"
                                                if len(dropped) > 5 else "")


def _settings(config: dict, source: str) -> Settings:
    """What the DeepSpeed config (from ``source``) says; ConfigError for what cannot be
    exported."""

    def section(name) -> dict:
        value = config.get(name) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {name!r} is not an object")
        return value

    zero = section("zero_optimization")
    stage = zero.get("stage", 0)
    bf16 = (section("bf16") or section("bfloat16")).get("enabled", False)
    fp16 = section("fp16").get("enabled", False)
    clip = config.get("gradient_clipping", 0.0)
    if stage not in (0, 1, 2, 3) or not isinstance(bf16, bool) or not isinstance(fp16, bool) \
            or not isinstance(clip, (int, float)) or isinstance(clip, bool):
        raise ConfigError(f"{source}: zero_optimization.stage, bf16.enabled, "
                         "fp16.enabled and gradient_clipping must be given as values (not 'auto')")
    offload = zero.get("cpu_offload") is True or \
        (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    refused = [what for what, on in (
        ("ZeRO stage 3", stage == 3),
        ("zero_optimization.elastic_checkpoint", zero.get("elastic_checkpoint")),
        ("zero_optimization.round_robin_gradients", zero.get("round_robin_gradients")),
        ("NVMe optimizer offload", (zero.get("offload_optimizer") or {}).get("device") == "nvme"),
        ("fp32 training (neither bf16 nor fp16 enabled)", not bf16 and not fp16)) if on]
    if refused:
        raise ConfigError(f"{source}: --to deepspeed does not export {refused[0]}")
    accum = section("data_types").get("grad_accum_dtype")
    return Settings(config, source, stage, torch.bfloat16 if bf16 else torch.float16, clip,
                    bf16 and accum in FP32, offload)


def _check_dtype(s: Settings, part: Part) -> None:
    """The config's precision must be the module weights'."""
    weights = {t.dtype for n, ref in part.m.model.params.items() if n.startswith("module.")
               for t in [ref.resolve(part.tensors)] if t.is_floating_point()}
    if weights and s.dtype not in weights:
        raise ConfigError(f"{s.source} trains in {_dtype_name(s.dtype)}, the "
                         f"checkpoint's module weights are {', '.join(map(_dtype_name, weights))}")


def _kind(part: Part, s: Settings) -> str:
    """The optimizer wrapper the config builds, which must be the one that was checkpointed."""
    if s.stage == 0:
        kind = STAGE0 if part.m.optimizer.cls == "FusedAdam" else UNFUSED
    elif s.stage == 1 and s.fp32_accumulation and not s.offload:
        kind = BF16
    else:
        kind = ZERO
    scalers = part.record["scalers"]
    recorded = STAGE0 if "loss_scale_config" in scalers else ZERO if "loss_scaler" in scalers \
        else BF16
    if recorded != (STAGE0 if kind == UNFUSED else kind):
        raise ConfigError(f"{s.source} (ZeRO stage {s.stage}) builds "
                         f"{kind}, the checkpoint was written by {_wrapper_of(recorded)}; "
                         "give the config the run trained with")
    return kind


def _wrapper_of(kind: str) -> str:
    return {STAGE0: "stage 0's FP16_Optimizer", ZERO: "ZeRO 1/2's DeepSpeedZeroOptimizer",
            BF16: "BF16_Optimizer (ZeRO 1, fp32 gradient accumulation)"}[kind]


def _groups(parts: List[Part]) -> List[Group]:
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


# ---------------------------------------------------------------------------------- writing


def _model_states(part: Part, optimized: set, s: Settings, kind: str, world: int, ds) -> dict:
    """What DeepSpeed's ``engine._save_checkpoint`` writes (dp rank 0's file); ``optimized``:
    the parameters some rank's fp32 master holds (the others are frozen)."""

    sd, aliases = model_state(part.path, part.m, part.tensors)
    module, copies = OrderedDict(), {}
    for name, value in sd.items():
        if name.startswith("module."):
            canon = aliases.get(name, name)  # tied names: one tensor, as module.state_dict()
            if canon not in copies:
                copies[canon] = _own(sd[canon]) if torch.is_tensor(sd[canon]) else sd[canon]
            module[name[len("module."):]] = copies[canon]
    buffers = [n[len("module."):] for n in _small(part, "model") if n.startswith("module.")]
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
        lr_scheduler=_small(part, "scheduler"),
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


def _stage0_optimizer(part: Part, s: Settings, kind: str) -> dict:
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
    out["optimizer_state_dict"] = _base_state(part)
    groups = sorted({g for g, _ in part.masters})
    if kind == UNFUSED:  # one fp32 master per parameter
        out["fp32_groups"] = [[_own(part.masters[g, p]) for p in
                               sorted(p for gg, p in part.masters if gg == g)] for g in groups]
    else:
        out["fp32_groups_flat"] = [_own(part.masters[g, 0]) for g in groups]
        out["clip_grad"] = s.clip
    return out


def _zero_optimizer(part: Part, rank: int, groups: List[Group], s: Settings, kind: str,
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
        partitions.append(_own(master if kind == BF16 else master[:size - padding]))
        layout = part.record["fp32_layout"]
        mappings.append(OrderedDict((n, ds.fragment_address(numel=layout[n][3], start=layout[n][1]))
                                    for n in group.names if n in layout and layout[n][0] == g))
    if any(any(p < 0 for p in pp) for pp in param_paddings):
        raise CorruptCheckpointError(f"{part.path}: parameters overlap in the fp32 layout")
    osd = {}
    if kind == ZERO:
        scaler, overflow = _loss_scaler(part, s, ds)
        osd.update(loss_scaler=scaler, dynamic_loss_scale=scaler.dynamic, overflow=overflow)
    osd["clip_grad"] = s.clip
    osd["base_optimizer_state"] = _base_state(part)
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


def _loss_scaler(part: Part, s: Settings, ds) -> tuple:
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


def _base_state(part: Part) -> dict:
    """The base optimizer's ``state_dict()`` (its state in index order, own storage)."""

    osd = optimizer_state(part.path, part.m, part.tensors)
    osd["state"] = {i: {k: _own(v) if torch.is_tensor(v) else v for k, v in st.items()}
                    for i, st in osd["state"].items()}
    return osd


def _small(part: Part, section: str):
    """A small-state section's value (the scheduler's is None without a scheduler)."""
    try:
        return part.m.small.decode(section, part.tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{part.path}: the small state {section!r} is unreadable "
                            f"({one_line(exc)})") from None


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own (a stored tensor may be a view into a packed one, and
    ``torch.save`` writes a view's whole storage)."""
    return t.clone()


def one_line(exc) -> str:
    """An exception (or message) as one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def describe(export: Export) -> str:
    """One line: what was written."""
    what = f"ZeRO stage {export.stage}" if export.kind in (ZERO, BF16) else "stage 0"
    optim = f" + {export.world} optimizer partition(s)" if export.kind in (ZERO, BF16) else ""
    config = "the config recorded in the checkpoint" if export.config_from == RECORDED \
        else export.config_from
    return (f"DeepSpeed checkpoint {export.tag} ({what}, {export.kind}, {export.world} "
            f"rank(s)): mp_rank_00_model_states.pt{optim}; ds_config: {config}")

