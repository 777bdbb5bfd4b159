"""The replay adapters of DeepSpeed's ``FusedAdam``: on the CPU its CPU Adam op, every line
(below); on CUDA its moments, the parameters copied at F (:class:`DeepSpeedCudaAdamAdapter`).

The op keeps ``beta1^t``, ``beta2^t`` as float32 running products in one process-wide object
per mode (docs/arithmetics.md), so the bias corrections of a step depend on the op's history,
not on t alone.  The adapter mirrors that object: a step pre-hook of its own (registered before
the Checkpointer's) replays ``IncrementStep`` for every group at every step, checkpoint or not.
Its state when the adapter is built (a DeepSpeed engine builds its Checkpointer at the first
save, in the middle of training) is read from the op itself by a probe that cannot change it:
a call on scratch values at the op's current step returns before touching the products, and
its outputs are compared with the replay of each history the process may have had.  When no
history matches, the steps are reported as not replayable (the checkpoint is copied at its
step, with a warning) and the op is read again before the next step: training never stops
for it.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from ...replay import arithmetic
from ...replay.adapters import AdamAdapter
from ...core.records import GroupScalars, Kernel
from ...replay.claims import replay_claims
from ...replay.probe import probe

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
        self.impl = Kernel.deepspeed_cpu(self.width)
        for gi, g in enumerate(optimizer.param_groups):
            if not g.get("bias_correction", True) or g.get("amsgrad", False):
                refuse(optimizer, f"param group {gi} sets bias_correction=False or amsgrad")
            for p in g["params"]:
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    refuse(optimizer, f"a parameter of group {gi} is {p.dtype} on {p.device}; "
                                      "DeepSpeed's FusedAdam is replayed for CPU float32 only "
                                      "(its CUDA kernel is built with --use_fast_math)")
        self.mode = bool(getattr(optimizer, "adam_w_mode", True))
        self.why_not: Optional[str] = None  # why the op's state is not known (no replay now)
        self._resync_next = False
        self.mirror: Optional[_OpMirror] = self._read_op_state()
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
        steps = self._group_steps()
        if self.mirror is None and self._resync_next:  # the op still has the last update's
            self._resync_next = False                  # products: read them before this step
            self.mirror = self._read_op_state()
        self.current = {}
        if self.mirror is None:
            return
        for gi, t in steps.items():
            b1, b2 = optimizer.param_groups[gi]["betas"]
            self.current[gi] = self.mirror.increment(t, b1, b2)

    def _read_op_state(self) -> Optional[_OpMirror]:
        """The mirror of the op's products after the last update, read from the op (None when
        no reading is certain). The last update called the op at the largest step count of
        this optimizer's state with the groups' betas, which must all be equal (with several
        betas the op would have switched between them): there, IncrementStep returns at once,
        so a call on scratch values reads the products without changing them."""
        steps = [int(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        if not steps:
            self.why_not = None
            return _OpMirror()  # no step yet in this process's op (or a fresh one)
        betas = {(float(g["betas"][0]), float(g["betas"][1])) for g in self.optimizer.param_groups}
        if len(betas) != 1:
            self.why_not = "its param groups have different betas"
            return None
        t, b = max(steps), betas.pop()
        powers = _probe_powers(self.optimizer, self.mode, self.width, b, t, _histories(b, t))
        if powers is None:
            self.why_not = (f"the state of DeepSpeed's CPU Adam op at step {t} is neither the "
                            "running product from step 1 nor one started by pow(beta, s) "
                            f"at a step s >= {max(1, t - _RESUME_WINDOW)} (another optimizer "
                            "shares it, or its betas changed)")
            return None
        self.why_not = None
        return _OpMirror((F32(b[0]), F32(b[1])), t, powers)

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

    def params_not_replayed(self) -> dict:
        """None: the CPU op's every line is reproduced."""
        return {}

    def skipped_by_scaler(self) -> bool:
        return False

    def unsupported_step(self) -> Optional[str]:
        """Why this step cannot be replayed: the op's running products are not known (the
        checkpoint is then copied at its step). The op is read again before the next step."""
        if self.mirror is None:
            self._resync_next = True
            return self.why_not
        return None


# How far back a process's first step (the op's pow) is looked for.
_RESUME_WINDOW = 4096


def _histories(betas, t: int) -> list:
    """The op's possible (beta1^t, beta2^t) after step t, most likely first: the running
    product from step 1 (a process that stepped 1..t, or resumed through gockpt, which
    rebuilds it), then pow(beta, s) followed by the product from s to t, for s from t down
    to ``t - _RESUME_WINDOW`` (a process whose first step was s: DeepSpeed's own resume)."""
    b = np.array([F32(betas[0]), F32(betas[1])], dtype=np.float32)
    first = max(1, t - _RESUME_WINDOW)
    s = np.arange(first, t + 1)
    # pow(float, size_t) in double, rounded to float: what IncrementStep does at a jump
    runs = np.stack([np.power(np.float64(x), s.astype(np.float64)) for x in b],
                    axis=1).astype(np.float32)
    for u in range(first + 1, t + 1):  # step u multiplies the runs started before it
        runs[:u - first] *= b
    out = [tuple(float(x) for x in _chain(betas, t))]
    seen = {out[0]}
    for row in runs[::-1]:
        pair = (float(row[0]), float(row[1]))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def _chain(betas, t: int) -> tuple:
    """The op's products after steps 1..t in a row from a fresh object."""
    m = _OpMirror()
    powers = (1.0, 1.0)
    for step in range(1, t + 1):
        powers = m.increment(step, *betas)
    return powers


def _probe_powers(optimizer, mode: bool, width: int, betas, t: int, candidates):
    """Which of the ``candidates`` (beta1^t, beta2^t) DeepSpeed's op holds at step ``t``: the
    op's call at its current step on scratch values against the replay with each. The scratch
    makes the bias corrections visible to the last bit: parameters 0 and lr 1, so that each
    output is ``(m / den) / (1 - beta1^t)`` rounded once, ``den = sqrt(v) / sqrt(1 - beta2^t)``
    (with parameters near 1 and lr 1e-3 a bias correction one ulp off changes nothing, and two
    different products both matched: betas 0.95 to 0.99 were refused). Candidates that give
    the same outputs give the same update at this step; the running product from step 1 is
    then taken, as it is what a process that stepped 1..t holds. None: none matches."""
    candidates = [tuple(float(x) for x in c) for c in candidates]
    scratch = _scratch(_PROBE_ELEMENTS)
    got = [x.clone() for x in scratch]
    run_cpu_adam_op(optimizer, *got, lr=1.0, betas=betas, eps=0.0, weight_decay=0.0, step=t)
    for powers in candidates:  # the running product first
        want = [x.clone() for x in scratch]
        arithmetic.replay_step(f"cpu/deepspeed/FusedAdam/adam_w_mode={mode}", *want[:3],
                               want[3], lr=1.0, betas=betas, eps=0.0, weight_decay=0.0,
                               step=t, beta_powers=powers, simd_width=width)
        if all(torch.equal(x, y) for x, y in zip(want[:3], got[:3])):
            return powers
    return None


# SIMD blocks of every width plus a scalar tail (the op's two code paths), with enough
# distinct values that a bias correction one ulp off changes some output.
_PROBE_ELEMENTS = 1024 + 7


def _scratch(n: int):
    rng = np.random.default_rng(12345)
    p = torch.zeros(n)
    m = torch.from_numpy((rng.standard_normal(n) * 1e-2).astype(np.float32))
    v = torch.from_numpy((rng.random(n) * 1e-3 + 1e-6).astype(np.float32))  # den > 0
    g = torch.from_numpy((rng.standard_normal(n) * 1e-1).astype(np.float32))
    return [p, m, v, g]


class DeepSpeedCudaAdamAdapter:
    """DeepSpeed ``FusedAdam`` on CUDA float32 tensors: its moments replayed bit for bit
    (``cuda/deepspeed/FusedAdam``: the ``deepspeed-cuda-moments`` kernel), its parameters
    copied at F -- the kernel is built with ``--use_fast_math`` and its parameter line divides
    and takes square roots approximately (gockpt.replay.claims). Adam mode with weight decay
    is refused: its moments read the parameter."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer, refuse):
        self.optimizer = optimizer
        self.mode = bool(getattr(optimizer, "adam_w_mode", True))
        self.profile = f"cuda/deepspeed/FusedAdam/adam_w_mode={self.mode}"
        for gi, g in enumerate(optimizer.param_groups):
            if not g.get("bias_correction", True) or g.get("amsgrad", False):
                refuse(optimizer, f"param group {gi} sets bias_correction=False or amsgrad")
            for p in g["params"]:
                if not p.is_cuda or p.dtype != torch.float32:
                    refuse(optimizer, f"a parameter of group {gi} is {p.dtype} on {p.device}; "
                                      "DeepSpeed's FusedAdam on CUDA is replayed for float32 "
                                      "parameters on one GPU")
            claims = replay_claims(self.profile, None, float(g["weight_decay"]))
            if claims["exp_avg"] is not None:
                refuse(optimizer, f"param group {gi}: {claims['exp_avg']}")
        for gi, sc in self.scalars().items():  # a fresh FusedAdam on the device, its moments
            params = optimizer.param_groups[gi]["params"]
            if params and not probe(type(optimizer), sc, params[0].device, moments_only=True):
                refuse(optimizer, f"param group {gi}: a probe replay of DeepSpeed's CUDA "
                                  "FusedAdam moments differs on this GPU")

    def close(self) -> None:
        pass

    def scalars(self) -> Dict[int, GroupScalars]:
        return {gi: GroupScalars(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                                 float(g["eps"]), float(g["weight_decay"]),
                                 Kernel.DEEPSPEED_CUDA_MOMENTS, self.mode)
                for gi, g in enumerate(self.optimizer.param_groups)}

    step_counts = DeepSpeedCpuAdamAdapter.step_counts
    apply = AdamAdapter.apply  # the moments of every block (the parameters: copied at F)
    scratch_params = AdamAdapter.scratch_params
    _scratch = None

    def params_not_replayed(self) -> dict:
        why = replay_claims(self.profile)["param"]
        return {id(p): why for g in self.optimizer.param_groups for p in g["params"]}

    def skipped_by_scaler(self) -> bool:
        return False

    def unsupported_step(self) -> Optional[str]:
        return None


def fused_adam_adapter(optimizer, refuse):
    """The replay adapter of DeepSpeed's ``FusedAdam`` (the ``gockpt.optimizer_adapters``
    entry point): its CPU op's, or on CUDA its moments'."""
    on_cuda = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
    return (DeepSpeedCudaAdamAdapter if on_cuda else DeepSpeedCpuAdamAdapter)(optimizer, refuse)


fused_adam_adapter.state_keys = DeepSpeedCpuAdamAdapter.state_keys
