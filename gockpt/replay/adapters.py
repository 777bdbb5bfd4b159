"""Optimizer adapters: one per optimizer arithmetic the replay reproduces bitwise.

An adapter refuses, at attach time, any setting it cannot reproduce exactly; at each optimizer
step it turns the live param groups and state into plain scalars (:mod:`.records`); and it
applies a recorded step to a block of the host copy through the C++ kernel (:mod:`.arithmetic`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..capture.plan import Block
from ..modes import NO_REPLAY_MODES
from ..errors import UnsupportedOptimizerError
from . import arithmetic
from .probe import probe
from .records import GroupScalars, StepRecord


def _refuse(optimizer, why: str):
    modes = ", ".join(NO_REPLAY_MODES)
    raise UnsupportedOptimizerError(
        f"{type(optimizer).__name__}: {why}. The gockpt modes replay optimizer steps and only "
        "do so where the replay is bitwise exact (torch.optim.Adam/AdamW with float lr and "
        "betas, no amsgrad/maximize/capturable/differentiable, float32 parameters). Use one of "
        f"the modes that need no replay: {modes}.")


class AdamAdapter:
    """torch.optim.Adam and torch.optim.AdamW on CPU float32 tensors, in their default
    (single-tensor), foreach and fused implementations."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer: torch.optim.Optimizer):
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            _refuse(optimizer, "no bitwise replay exists for this optimizer class")
        self.optimizer = optimizer
        for gi, g in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if g.get(flag, False):
                    _refuse(optimizer, f"param group {gi} sets {flag}=True")
            for key in ("lr", "eps", "weight_decay"):
                if isinstance(g.get(key), torch.Tensor):
                    _refuse(optimizer, f"param group {gi} has a tensor {key}")
            if any(isinstance(b, torch.Tensor) for b in g["betas"]):
                _refuse(optimizer, f"param group {gi} has tensor betas")
            for p in g["params"]:
                if p.dtype != torch.float32:
                    _refuse(optimizer, f"a parameter of group {gi} is {p.dtype}, not float32")
                if p.device.type != "cpu":
                    _refuse(optimizer, "the bitwise replay is proven for CPU training tensors; "
                                       f"a parameter lives on {p.device}")
        ok, reason = arithmetic.exactness_supported()
        if not ok:
            _refuse(optimizer, f"this torch build cannot be replayed exactly ({reason})")
        for gi, sc in self.scalars().items():
            if not probe(type(optimizer), sc):
                _refuse(optimizer, f"a probe replay of param group {gi}'s settings ({sc}) "
                                   f"differs from torch {torch.__version__} on this machine")

    def scalars(self) -> Dict[int, GroupScalars]:
        """The scalars every group's update uses right now (call inside the step pre-hook)."""
        out = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            if g.get("fused"):
                impl = "fused"
            elif g.get("foreach"):
                impl = "foreach"
            else:
                impl = "single"  # torch's default on CPU tensors
            decoupled = bool(g.get("decoupled_weight_decay",
                                   isinstance(self.optimizer, torch.optim.AdamW)))
            out[gi] = GroupScalars(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                                   float(g["eps"]), float(g["weight_decay"]), impl, decoupled)
        return out

    def step_count(self, param: torch.Tensor) -> float:
        """t of the update about to run on ``param`` (torch increments before using it)."""
        st = self.optimizer.state.get(param)
        if not st or "step" not in st:
            return 1.0
        return float(st["step"]) + 1.0

    def skipped_by_scaler(self) -> bool:
        """A fused step with GradScaler's found_inf set returns before touching any state."""
        found_inf = getattr(self.optimizer, "found_inf", None)
        return found_inf is not None and float(found_inf) != 0.0

    def unsupported_step(self) -> Optional[str]:
        """Why the step about to run cannot be replayed (None if it can)."""
        if getattr(self.optimizer, "grad_scale", None) is not None:
            return ("the fused optimizer is unscaling gradients itself (GradScaler.step without "
                    "unscale_); call scaler.unscale_(optimizer) before ck.update_begin()")
        return None

    def apply(self, record: StepRecord, block: Block, host, threads: Optional[int]) -> None:
        """Apply one recorded step to one block of the host copy, in place."""
        slot = host.slots[block.slot]
        sc = record.scalars[slot.group]
        s, e = block.start, block.end
        arithmetic.adam_replay(
            host.param[block.slot][s:e], host.state[block.slot]["exp_avg"][s:e],
            host.state[block.slot]["exp_avg_sq"][s:e], record.grads[block.slot][s:e],
            impl=sc.impl, decoupled=sc.decoupled, lr=sc.lr, beta1=sc.beta1, beta2=sc.beta2,
            eps=sc.eps, weight_decay=sc.weight_decay, step=record.steps[block.slot],
            offset=s, full_numel=slot.numel, threads=threads)


def adapter_for(optimizer: torch.optim.Optimizer) -> AdamAdapter:
    """The replay adapter for ``optimizer``; raises UnsupportedOptimizerError if none is exact."""
    return AdamAdapter(optimizer)
