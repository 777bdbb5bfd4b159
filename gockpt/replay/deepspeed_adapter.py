"""The replay adapter of DeepSpeed's ``FusedAdam`` on the CPU (its CPU Adam op).

The op keeps ``beta1^t``, ``beta2^t`` as float32 running products in one process-wide object
per mode (docs/arithmetics.md), so the bias corrections of a step depend on the op's history,
not on t alone.  The adapter mirrors that object: a step pre-hook of its own (registered before
the Checkpointer's) replays ``IncrementStep`` for every group at every step, checkpoint or not.
Its state when the adapter is built is read from the op itself by a probe that cannot change
it: a call on scratch values at the op's current step returns before touching the products.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from . import arithmetic
from .adapters import AdamAdapter
from .records import GroupScalars

F32 = np.float32


def run_cpu_adam_op(optimizer, p, m, v, g, *, lr: float, betas, eps: float,
                    weight_decay: float, step: int) -> None:
    """One call of the CPU Adam op of DeepSpeed's ``FusedAdam`` ``optimizer`` on one tensor
    (param ``p``, moments ``m``, ``v`` updated in place; gradient ``g``), as its step() makes
    it -- which also advances the op's running beta products (see :class:`_OpMirror`)."""
    optimizer.multi_tensor_adam(2048 * 32, torch.zeros(1, dtype=torch.int), [[g], [p], [m], [v]],
                                lr, betas[0], betas[1], eps, int(step),
                                int(getattr(optimizer, "adam_w_mode", True)), 1, weight_decay)


def is_deepspeed_fused_adam(optimizer) -> bool:
    cls = type(optimizer)
    return cls.__name__ == "FusedAdam" and cls.__module__.startswith("deepspeed.")


class _OpMirror:
    """``Adam_Optimizer::IncrementStep`` of DeepSpeed's op, in float32."""

    def __init__(self, betas=None, step=0, powers=(1.0, 1.0)):
        self.betas = betas                        # None: the op's placeholders (never equal)
        self.step = step
        self.powers = (F32(powers[0]), F32(powers[1]))

    def increment(self, step: int, b1: float, b2: float) -> tuple:
        b = (F32(b1), F32(b2))
        if self.betas is None or b != self.betas:
            self.betas, self.step, self.powers = b, step, _pow(b, step)
        elif step == self.step + 1:
            self.step = step
            self.powers = (F32(self.powers[0] * b[0]), F32(self.powers[1] * b[1]))
        elif step != self.step:
            self.step, self.powers = step, _pow(b, step)
        return float(self.powers[0]), float(self.powers[1])


def _pow(betas, step: int) -> tuple:
    return tuple(F32(float(b) ** int(step)) for b in betas)  # std::pow(float, size_t): double


class DeepSpeedCpuAdamAdapter:
    """DeepSpeed ``FusedAdam`` on CPU float32 tensors (ZeRO 0/1/2 and BF16_Optimizer hand it
    one flat fp32 partition per param group)."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer, refuse):
        self.optimizer = optimizer
        self.width = arithmetic.deepspeed_simd_width()
        self.impl = f"deepspeed-cpu-w{self.width}"
        for gi, g in enumerate(optimizer.param_groups):
            if not g.get("bias_correction", True) or g.get("amsgrad", False):
                refuse(optimizer, f"param group {gi} sets bias_correction=False or amsgrad")
            for p in g["params"]:
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    refuse(optimizer, f"a parameter of group {gi} is {p.dtype} on {p.device}; "
                                      "DeepSpeed's FusedAdam is replayed for CPU float32 only "
                                      "(its CUDA kernel is built with --use_fast_math)")
        self.mode = bool(getattr(optimizer, "adam_w_mode", True))
        self.mirror = self._probe_mirror(refuse)
        self.current: Dict[int, tuple] = {}
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def close(self) -> None:
        self._hook.remove()

    # ------------------------------------------------------------------ the op's history

    def _group_steps(self) -> Dict[int, int]:
        """t of the update about to run, per group (FusedAdam: the last param with a
        gradient's state step + 1, or the group's own step for a new state)."""
        out = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            last = [p for p in g["params"] if p.grad is not None]
            if last:
                st = self.optimizer.state.get(last[-1]) or {}
                out[gi] = int(st.get("step", g.get("step", 0))) + 1
        return out

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.current = {}
        for gi, t in self._group_steps().items():
            b1, b2 = optimizer.param_groups[gi]["betas"]
            self.current[gi] = self.mirror.increment(t, b1, b2)

    def _probe_mirror(self, refuse) -> _OpMirror:
        steps = [int(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        if not steps:
            return _OpMirror()  # no step yet in this process's op (or a fresh one)
        t = max(steps)
        g = self.optimizer.param_groups[0]
        b = (float(g["betas"][0]), float(g["betas"][1]))
        candidates = [_chain(b, t), tuple(float(x) for x in _pow((F32(b[0]), F32(b[1])), t))]
        scratch = _scratch(64)
        got = [x.clone() for x in scratch]
        # At the op's current step with its betas, IncrementStep returns at once: the
        # products are read, not changed.
        run_cpu_adam_op(self.optimizer, *got, lr=1e-3, betas=b, eps=1e-8, weight_decay=0.0,
                        step=t)
        found = []
        for powers in candidates:
            want = [x.clone() for x in scratch]
            arithmetic.replay_step(f"cpu/deepspeed/FusedAdam/adam_w_mode={self.mode}",
                                   *want[:3], want[3], lr=1e-3, betas=b, eps=1e-8,
                                   weight_decay=0.0, step=t, beta_powers=powers,
                                   simd_width=self.width)
            if all(torch.equal(x, y) for x, y in zip(want[:3], got[:3])):
                found.append(powers)
        if not found or len(set(found)) > 1:
            refuse(self.optimizer, f"the state of DeepSpeed's CPU Adam op at step {t} is "
                                   "neither the running product from step 1 nor pow(beta, t) "
                                   "(another optimizer shares it, or its betas changed)")
        return _OpMirror((F32(b[0]), F32(b[1])), t, found[0])

    # ------------------------------------------------------------------ the adapter protocol

    def scalars(self) -> Dict[int, GroupScalars]:
        out = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            b1t, b2t = self.current.get(gi, (0.0, 0.0))
            out[gi] = GroupScalars(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                                   float(g["eps"]), float(g["weight_decay"]), self.impl,
                                   self.mode, b1t, b2t)
        return out

    def step_counts(self, slots, states) -> Dict[int, float]:
        """t of the update about to run per slot (a Python int in FusedAdam's state)."""
        return {si: float(int(states[si]["step"]) + 1)
                if states[si] is not None and "step" in states[si] else 1.0 for si in slots}

    apply = AdamAdapter.apply  # one batched kernel call; the scalars carry the beta powers

    def skipped_by_scaler(self) -> bool:
        return False

    def unsupported_step(self) -> Optional[str]:
        return None


def _chain(betas, t: int) -> tuple:
    """The op's products after steps 1..t in a row from a fresh object."""
    m = _OpMirror()
    powers = (1.0, 1.0)
    for step in range(1, t + 1):
        powers = m.increment(step, *betas)
    return powers


def _scratch(n: int):
    rng = np.random.default_rng(12345)
    p = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    m = torch.from_numpy((rng.standard_normal(n) * 1e-2).astype(np.float32))
    v = torch.from_numpy((rng.random(n) * 1e-3).astype(np.float32))
    g = torch.from_numpy((rng.standard_normal(n) * 1e-1).astype(np.float32))
    return [p, m, v, g]
