"""Thin wrapper over the C++ core ``gockpt._C``: exact replay of Adam/AdamW steps.

``adam_replay`` reproduces, bitwise, one update of ``torch.optim.Adam`` / ``torch.optim.AdamW``
(torch 2.13, CPU, float32) for a contiguous slice ``[offset, offset+n)`` of one parameter; the
library's adapters call it.  ``replay_step`` is the public entry point: one update with a named
arithmetic profile (``replay_arithmetics()``), the CPU ones above and the CUDA torch ones proven
on golden vectors recorded on an H100 (docs/arithmetics.md).  All scalar math (bias corrections,
rounding to float32, CUDA's powf) lives in C++ (``csrc/adam_replay.cpp``, ``csrc/cuda_math.cpp``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from gockpt import _C

__all__ = ["adam_replay", "replay_step", "replay_arithmetics", "sqrt_backend",
           "exactness_supported", "torch_vec_size", "IMPLS"]

IMPLS = ("single", "foreach", "fused")
CUDA_IMPLS = ("cuda-forloop", "cuda-foreach", "cuda-fused")  # torch's CUDA kernels (replay_step)

# Profile name "<device>/<source>/<optimizer>/<impl>" -> (kernel impl, decoupled weight decay).
_PROFILES = {
    **{f"cpu/torch/{opt}/{impl}": (impl, opt == "AdamW")
       for opt in ("Adam", "AdamW") for impl in IMPLS},
    **{f"cuda/torch/{opt}/{impl}": (f"cuda-{impl}", opt == "AdamW")
       for opt in ("Adam", "AdamW") for impl in ("forloop", "foreach", "fused")},
}
# Recorded but not reproducible: refused with the reason (docs/arithmetics.md).
_UNPROVEN = {
    f"cuda/deepspeed/FusedAdam/adam_w_mode={mode}": (
        "DeepSpeed builds its CUDA FusedAdam with --use_fast_math: the update divides with "
        "div.approx.ftz.f32 and takes sqrt.approx.ftz.f32 (MUFU.RCP / MUFU.SQRT hardware "
        "approximations that are not specified bit for bit); the moments are reproduced, the "
        "parameters are not")
    for mode in (True, False)
}


def _libtorch_cpu_path() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


# torch (imported above) has loaded libtorch_cpu, which exports MKL's vmsSqrt.
_C.init_vml_sqrt(_libtorch_cpu_path())


def sqrt_backend() -> str:
    """'mkl-vml' when torch's sqrt (MKL vmsSqrt) is reproduced, 'ieee' otherwise."""
    return _C.sqrt_backend()


_VEC_SIZE = None


def torch_vec_size() -> int:
    """Vectorized<float>::size() of the ATen kernels torch dispatches to on this CPU."""
    global _VEC_SIZE
    if _VEC_SIZE is None:
        cap = str(torch.backends.cpu.get_cpu_capability()).upper()
        _VEC_SIZE = 16 if cap.startswith("AVX512") else 8  # AVX2/DEFAULT: 32-byte vectors
    return _VEC_SIZE


def exactness_supported():
    """(ok, reason): whether this torch build's CPU kernels are the ones the replay reproduces.

    Verified: torch 2.13 CPU with ATen capability AVX512 or AVX2 (FMA kernels), float32.
    ATEN_CPU_CAPABILITY=default compiles ATen without FMA, which changes torch's arithmetic.
    """
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    if not (cap.startswith("AVX512") or cap.startswith("AVX2")):
        return False, f"ATen CPU capability {cap}: torch's arithmetic is not the FMA one replayed"
    if sqrt_backend() != "mkl-vml" and torch.backends.mkl.is_available():
        return False, "torch uses MKL vmsSqrt but it could not be resolved (IEEE sqrt fallback)"
    return True, f"ATen {cap}, sqrt {sqrt_backend()}"


def _check(name: str, t, n: Optional[int], flat_only: bool = True) -> int:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    if flat_only and t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements, expected {n} (same as param)")
    return t.numel()


def _check_buffers(param, exp_avg, exp_avg_sq, grad, flat_only: bool = True) -> int:
    """Validated element count of the four tensors; the three updated ones must not overlap
    each other or the gradient."""
    n = _check("param", param, None, flat_only)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)):
        _check(name, t, n, flat_only)
    spans = [(t.data_ptr(), t.data_ptr() + 4 * n) for t in (param, exp_avg, exp_avg_sq, grad)]
    for i in range(3):
        for j in range(i + 1, 4):
            if n > 0 and spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]:
                raise ValueError("param, exp_avg and exp_avg_sq must be distinct buffers "
                                 "(not overlapping each other or grad)")
    return n


def _check_scalars(step, **hyper) -> float:
    step = float(step)
    if not step >= 1:
        raise ValueError(f"step must be >= 1 (the count after increment), got {step}")
    for nm, val in hyper.items():
        if isinstance(val, torch.Tensor):
            raise ValueError(f"{nm} must be a Python float (tensor hyper-parameters unsupported)")
    return step


def _run(tensors, n, impl, decoupled, hp, step, offset, full_numel, torch_threads, threads,
         grad_scale=0.0) -> None:
    """The C++ kernel call shared by adam_replay and replay_step (ValueError on refusal)."""
    p, m, v, g = (t.data_ptr() for t in tensors)
    _C.adam_replay(p, m, v, g, n, impl, bool(decoupled), float(hp["lr"]), float(hp["beta1"]),
                   float(hp["beta2"]), float(hp["eps"]), float(hp["weight_decay"]), step,
                   offset, full_numel, int(torch_threads), torch_vec_size(), int(threads),
                   float(grad_scale))


def adam_replay(param, exp_avg, exp_avg_sq, grad, *, impl: str, decoupled: bool, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                offset: int = 0, full_numel: Optional[int] = None,
                torch_threads: Optional[int] = None, threads: Optional[int] = None,
                grad_scale: Optional[float] = None) -> None:
    """Replay one Adam (decoupled=False) / AdamW (decoupled=True) update in place.

    param, exp_avg, exp_avg_sq are updated in place; grad is read only.  ``step`` is the step
    count of this update (state['step'] after torch incremented it; 1 on the first update).
    ``offset``/``full_numel`` locate the slice inside the full parameter (``full_numel``
    defaults to ``offset + n``, i.e. ``n`` for a whole parameter): torch's fused CPU kernel
    computes exp_avg_sq with a different FMA placement for the last ``full_numel % 8`` elements.
    ``torch_threads`` is accepted and validated but measured to have no effect on torch's
    arithmetic (its elementwise scalar tails round exactly like the vector bodies).
    ``threads``: replay threads (default ``os.cpu_count()``); results do not depend on it.
    ``impl``: one of ``IMPLS`` (torch's CPU kernels) or ``CUDA_IMPLS`` (torch's CUDA kernels,
    see ``replay_step``; ``grad_scale`` only with ``"cuda-fused"``).
    """
    if impl not in IMPLS + CUDA_IMPLS:
        raise ValueError(f"impl must be one of {IMPLS + CUDA_IMPLS}, got {impl!r}")
    n = _check_buffers(param, exp_avg, exp_avg_sq, grad)
    if full_numel is None:
        full_numel = n + int(offset)
    offset, full_numel = int(offset), int(full_numel)
    if offset < 0 or full_numel < 0 or offset + n > full_numel:
        raise ValueError(f"slice [offset={offset}, offset+n={offset + n}) is not inside "
                         f"[0, full_numel={full_numel})")
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step = _check_scalars(step, **hp)
    if torch_threads is None:
        torch_threads = torch.get_num_threads()
    if threads is None:
        threads = os.cpu_count() or 1
    if int(threads) < 1 or int(torch_threads) < 1:
        raise ValueError("threads and torch_threads must be >= 1")
    _run((param, exp_avg, exp_avg_sq, grad), n, impl, decoupled, hp, step, offset, full_numel,
         torch_threads, threads, grad_scale or 0.0)


def replay_arithmetics() -> list:
    """Names of the arithmetic profiles ``replay_step`` reproduces bit for bit, sorted.

    ``"<device>/<source>/<optimizer>/<impl>"``: ``cpu/torch/{Adam,AdamW}/{single,foreach,fused}``
    (torch's CPU kernels, checked against torch itself) and
    ``cuda/torch/{Adam,AdamW}/{forloop,foreach,fused}`` (torch >= 2.11 CUDA kernels, proven on
    golden vectors recorded on an NVIDIA H100).  Profiles recorded but not reproducible (DeepSpeed
    FusedAdam on CUDA) are not listed and are refused.
    """
    return sorted(_PROFILES)


def _profile(arithmetic: str):
    if arithmetic in _UNPROVEN:
        raise ValueError(f"arithmetic {arithmetic!r} is not replayable bit for bit: "
                         f"{_UNPROVEN[arithmetic]}")
    if arithmetic not in _PROFILES:
        raise ValueError(f"unknown arithmetic {arithmetic!r}; known: "
                         f"{', '.join(replay_arithmetics())}")
    return _PROFILES[arithmetic]


def replay_step(arithmetic: str, param, exp_avg, exp_avg_sq, grad, *, lr: float, betas,
                eps: float, weight_decay: float, step, grad_scale: Optional[float] = None) -> None:
    """Apply one Adam/AdamW update in place, bit for bit as the named optimizer computes it.

    ``arithmetic``: a name from ``replay_arithmetics()``, e.g. ``"cuda/torch/AdamW/fused"``,
    ``"cuda/torch/Adam/foreach"``, ``"cpu/torch/AdamW/single"``.
    ``param``, ``exp_avg``, ``exp_avg_sq`` (updated in place) and ``grad`` (read only): float32
    CPU tensors, contiguous, of any shape, with the same number of elements; the three updated
    ones are distinct buffers not overlapping each other or ``grad``.  Each is taken as the whole
    parameter, flattened in memory order (the CUDA fused kernel's rounding depends on an
    element's index mod 4).
    ``lr``, ``betas`` (beta1, beta2), ``eps``, ``weight_decay``: the param group's Python floats.
    ``step``: the step count of this update, after the optimizer's increment (1 on the first).
    ``grad_scale``: the GradScaler scale the CUDA fused kernel unscales by itself (``grad`` is then
    the scaled gradient, as the kernel receives it); refused by every other arithmetic.
    Raises ValueError for an unknown or unproven arithmetic, bad tensors, or a setting the profile
    has no proof for (docs/arithmetics.md says which).
    """
    impl, decoupled = _profile(arithmetic)
    if grad_scale is not None and impl != "cuda-fused":
        raise ValueError(f"grad_scale is taken only by the CUDA fused arithmetics, not by "
                         f"{arithmetic!r}")
    if grad_scale is not None and not float(grad_scale) > 0:
        raise ValueError(f"grad_scale must be a positive float, got {grad_scale!r}")
    n = _check_buffers(param, exp_avg, exp_avg_sq, grad, flat_only=False)
    beta1, beta2 = betas
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step = _check_scalars(step, **hp)
    _run((param, exp_avg, exp_avg_sq, grad), n, impl, decoupled, hp, step, 0, n,
         torch.get_num_threads(), os.cpu_count() or 1, grad_scale or 0.0)
