"""Thin wrapper over the C++ core ``gockpt._C``: exact replay of torch Adam/AdamW steps.

``adam_replay`` reproduces, bitwise, one update of ``torch.optim.Adam`` / ``torch.optim.AdamW``
(torch 2.13, CPU, float32) for a contiguous slice ``[offset, offset+n)`` of one parameter.
All scalar math (bias corrections in double, rounding to float32) lives in C++
(``csrc/adam_replay.cpp: make_scalars``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from gockpt import _C

__all__ = ["adam_replay", "sqrt_backend", "exactness_supported", "torch_vec_size", "IMPLS"]

IMPLS = ("single", "foreach", "fused")


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


def _check(name: str, t, n: Optional[int]) -> int:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements, expected {n} (same as param)")
    return t.numel()


def adam_replay(param, exp_avg, exp_avg_sq, grad, *, impl: str, decoupled: bool, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                offset: int = 0, full_numel: Optional[int] = None,
                torch_threads: Optional[int] = None, threads: Optional[int] = None) -> None:
    """Replay one Adam (decoupled=False) / AdamW (decoupled=True) update in place.

    param, exp_avg, exp_avg_sq are updated in place; grad is read only.  ``step`` is the step
    count of this update (state['step'] after torch incremented it; 1 on the first update).
    ``offset``/``full_numel`` locate the slice inside the full parameter (``full_numel``
    defaults to ``offset + n``, i.e. ``n`` for a whole parameter): torch's fused CPU kernel
    computes exp_avg_sq with a different FMA placement for the last ``full_numel % 8`` elements.
    ``torch_threads`` is accepted and validated but measured to have no effect on torch's
    arithmetic (its elementwise scalar tails round exactly like the vector bodies).
    ``threads``: replay threads (default ``os.cpu_count()``); results do not depend on it.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    n = _check("param", param, None)
    _check("exp_avg", exp_avg, n)
    _check("exp_avg_sq", exp_avg_sq, n)
    _check("grad", grad, n)
    ptrs = {param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr()}
    if n > 0 and len(ptrs) != 3:
        raise ValueError("param, exp_avg and exp_avg_sq must be distinct buffers")
    if full_numel is None:
        full_numel = n + int(offset)
    offset, full_numel = int(offset), int(full_numel)
    if offset < 0 or full_numel < 0 or offset + n > full_numel:
        raise ValueError(f"slice [offset={offset}, offset+n={offset + n}) is not inside "
                         f"[0, full_numel={full_numel})")
    step = float(step)
    if not step >= 1:
        raise ValueError(f"step must be >= 1 (the count after increment), got {step}")
    for nm, val in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                    ("weight_decay", weight_decay)):
        if isinstance(val, torch.Tensor):
            raise ValueError(f"{nm} must be a Python float (tensor hyper-parameters unsupported)")
    if torch_threads is None:
        torch_threads = torch.get_num_threads()
    if threads is None:
        threads = os.cpu_count() or 1
    if int(threads) < 1 or int(torch_threads) < 1:
        raise ValueError("threads and torch_threads must be >= 1")
    _C.adam_replay(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                   n, impl, bool(decoupled), float(lr), float(beta1), float(beta2), float(eps),
                   float(weight_decay), step, offset, full_numel, int(torch_threads),
                   torch_vec_size(), int(threads))
