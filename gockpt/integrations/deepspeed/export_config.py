"""What of the DeepSpeed config decides the layout of ``gockpt export --to deepspeed``: the
config given (``--ds-config``) or the one recorded in the checkpoint, checked against each other
and against the checkpoint (see :mod:`gockpt.integrations.deepspeed.export`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...core.errors import ConfigError

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
                ("precision", dtype_name(self.dtype), dtype_name(other.dtype)),
                ("gradient_clipping", self.clip, other.clip),
                ("fp32 gradient accumulation (data_types.grad_accum_dtype)",
                 self.fp32_accumulation, other.fp32_accumulation),
                ("optimizer offload", self.offload, other.offload)):
            if a != b:
                out.append(f"{what} {a} (recorded: {b})")
        return out


def load_config(config_path: str) -> dict:
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


def choose(given: Optional[Settings], path: str, record: dict) -> Tuple[Settings, List[str]]:
    """The settings to export with, and notes to print: ``--ds-config``'s (``given``) checked
    against the recorded config, or the recorded config's."""
    config = record.get("ds_config")
    dropped = record.get("ds_config_dropped") or []
    if not isinstance(config, dict):
        if given is not None:
            return given, []
        why = "was written by a gockpt that did not record it" if "ds_config" not in record \
            else f"could not be recorded ({dropped_text(dropped)})"
        raise ConfigError(f"{path}: the DeepSpeed config {why}; pass --ds-config CONFIG, "
                         "the DeepSpeed config (JSON) the run trained with")
    lost = [d for d in dropped if isinstance(d, dict) and d.get("path")
            and d["path"][0] in LAYOUT_KEYS]
    if given is None and lost:
        raise ConfigError(f"{path}: {RECORDED} lacks what gockpt could not store of it "
                         f"({dropped_text(lost)}), which decides the layout; pass --ds-config "
                         "CONFIG, the DeepSpeed config (JSON) the run trained with")
    if given is None:
        s = settings_of(config, RECORDED)
        return s, [f"{RECORDED} lacks {dropped_text(dropped)} (not storable without pickle); "
                   "ds_config is written without it"] if dropped else []
    if lost:
        return given, [f"--ds-config not checked against {RECORDED}: it lacks "
                       f"{dropped_text(lost)}"]
    differences = given.differences(settings_of(config, RECORDED))
    if differences:
        raise ConfigError(f"{given.source} disagrees with {RECORDED} on what decides the "
                         f"layout: {'; '.join(differences)}. Leave --ds-config out to export "
                         "with the recorded config")
    return given, []


def dropped_text(dropped: list) -> str:
    def one(d):
        if not isinstance(d, dict):
            return repr(d)
        return f"{'.'.join(map(str, d.get('path') or [])) or 'the config'}: {d.get('type')}"
    return ", ".join(map(one, dropped[:5])) + (f" and {len(dropped) - 5} more"
                                                if len(dropped) > 5 else "")


def settings_of(config: dict, source: str) -> Settings:
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
    if type(stage) is not int or stage not in (0, 1, 2, 3) or not isinstance(bf16, bool) or not isinstance(fp16, bool) \
            or not isinstance(clip, (int, float)) or isinstance(clip, bool):
        raise ConfigError(f"{source}: zero_optimization.stage, bf16.enabled, "
                         "fp16.enabled and gradient_clipping must be given as values (not 'auto')")
    offload_optimizer = zero.get("offload_optimizer") or {}
    if not isinstance(offload_optimizer, dict):
        raise ConfigError(f"{source}: 'zero_optimization.offload_optimizer' is not an object")
    offload = zero.get("cpu_offload") is True or \
        offload_optimizer.get("device") in ("cpu", "nvme")
    refused = [what for what, on in (
        ("ZeRO stage 3", stage == 3),
        ("zero_optimization.elastic_checkpoint", zero.get("elastic_checkpoint")),
        ("zero_optimization.round_robin_gradients", zero.get("round_robin_gradients")),
        ("NVMe optimizer offload", offload_optimizer.get("device") == "nvme"),
        ("fp32 training (neither bf16 nor fp16 enabled)", not bf16 and not fp16)) if on]
    if refused:
        raise ConfigError(f"{source}: --to deepspeed does not export {refused[0]}")
    accum = section("data_types").get("grad_accum_dtype")
    return Settings(config, source, stage, torch.bfloat16 if bf16 else torch.float16, clip,
                    bf16 and accum in FP32, offload)


def check_dtype(s: Settings, weights: set) -> None:
    """The config's precision must be the module weights' (``weights``: their dtypes)."""
    if weights and s.dtype not in weights:
        raise ConfigError(f"{s.source} trains in {dtype_name(s.dtype)}, the "
                         f"checkpoint's module weights are {', '.join(map(dtype_name, weights))}")


def wrapper_kind(s: Settings, optimizer_cls: str, scalers: dict) -> str:
    """The optimizer wrapper the config builds, which must be the one that was checkpointed."""
    if s.stage == 0:
        kind = STAGE0 if optimizer_cls == "FusedAdam" else UNFUSED
    elif s.stage == 1 and s.fp32_accumulation and not s.offload:
        kind = BF16
    else:
        kind = ZERO
    recorded = STAGE0 if "loss_scale_config" in scalers else ZERO if "loss_scaler" in scalers \
        else BF16
    if recorded != (STAGE0 if kind == UNFUSED else kind):
        raise ConfigError(f"{s.source} (ZeRO stage {s.stage}) builds "
                         f"{kind}, the checkpoint was written by {wrapper_of(recorded)}; "
                         "give the config the run trained with")
    return kind


def wrapper_of(kind: str) -> str:
    return {STAGE0: "stage 0's FP16_Optimizer", ZERO: "ZeRO 1/2's DeepSpeedZeroOptimizer",
            BF16: "BF16_Optimizer (ZeRO 1, fp32 gradient accumulation)"}[kind]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def one_line(exc) -> str:
    """An exception (or message) as one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
