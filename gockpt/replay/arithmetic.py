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
from typing import Optional, Sequence

import numpy as np
import torch

from gockpt import _C
from gockpt.core.arrays import check_non_negative, int64_arrays

from .claims import check_tensors, moments_weight_decay

__all__ = ["adam_replay", "replay_batch", "replay_step", "replay_arithmetics", "sqrt_backend",
           "exactness_supported", "IMPLS"]

IMPLS = ("single", "foreach", "fused")
CUDA_IMPLS = ("cuda-forloop", "cuda-foreach", "cuda-fused")  # torch's CUDA kernels (replay_step)
# DeepSpeed's CPU Adam op built without SIMD, with AVX256 or with AVX512 (its vector width)
DEEPSPEED_IMPLS = ("deepspeed-cpu-w1", "deepspeed-cpu-w8", "deepspeed-cpu-w16")
# DeepSpeed's CUDA FusedAdam, its moments only (the parameter is left as it is: claims.py)
DEEPSPEED_CUDA_MOMENTS = "deepspeed-cuda-moments"
_ALL_IMPLS = IMPLS + CUDA_IMPLS + DEEPSPEED_IMPLS + (DEEPSPEED_CUDA_MOMENTS,)
# impl name -> its code in the records of replay_batch's args table (_C.REPLAY_ARGS_DTYPE)
_IMPL_CODES = {name: code for code, name in enumerate(_C.REPLAY_IMPLS)}

# Profile name "<device>/<source>/<optimizer>/<impl>" -> (kernel impl, decoupled weight decay).
_PROFILES = {
    **{f"cpu/torch/{opt}/{impl}": (impl, opt == "AdamW")
       for opt in ("Adam", "AdamW") for impl in IMPLS},
    **{f"cuda/torch/{opt}/{impl}": (f"cuda-{impl}", opt == "AdamW")
       for opt in ("Adam", "AdamW") for impl in ("forloop", "foreach", "fused")},
    **{f"cpu/deepspeed/FusedAdam/adam_w_mode={mode}": ("deepspeed-cpu", mode)
       for mode in (True, False)},
    # its moments only (claims.py): the parameter line is built with fast-math
    **{f"cuda/deepspeed/FusedAdam/adam_w_mode={mode}": (DEEPSPEED_CUDA_MOMENTS, mode)
       for mode in (True, False)},
}
def _libtorch_cpu_path() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


# torch (imported above) has loaded libtorch_cpu, which exports MKL's vmsSqrt.
_C.init_vml_sqrt(_libtorch_cpu_path())


def sqrt_backend() -> str:
    """'mkl-vml' when torch's sqrt (MKL vmsSqrt) is reproduced, 'ieee' otherwise."""
    return _C.sqrt_backend()


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


def _check_threads(threads: Optional[int]) -> int:
    threads = (os.cpu_count() or 1) if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


def deepspeed_simd_width() -> int:
    """The vector width (float32 lanes) DeepSpeed compiles its CPU Adam op with on this
    machine (its builder's rule: AVX512 if the CPU has it, else AVX256 if AVX2, else none)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return 1
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return 1
    if any(fl.startswith("avx512") for fl in flags):
        return 16
    return 8 if "avx2" in flags else 1


def _run(tensors, n, impl, decoupled, hp, step, offset, full_numel, threads,
         grad_scale=0.0, beta_powers=(0.0, 0.0)) -> None:
    """The C++ kernel call shared by adam_replay and replay_step (ValueError on refusal)."""
    p, m, v, g = (t.data_ptr() for t in tensors)
    _C.adam_replay(p, m, v, g, n, impl, bool(decoupled), float(hp["lr"]), float(hp["beta1"]),
                   float(hp["beta2"]), float(hp["eps"]), float(hp["weight_decay"]), step,
                   offset, full_numel, int(threads), float(grad_scale),
                   float(beta_powers[0]), float(beta_powers[1]))


def adam_replay(param, exp_avg, exp_avg_sq, grad, *, impl: str, decoupled: bool, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                offset: int = 0, full_numel: Optional[int] = None, threads: Optional[int] = None,
                grad_scale: Optional[float] = None) -> None:
    """Replay one Adam (decoupled=False) / AdamW (decoupled=True) update in place.

    param, exp_avg, exp_avg_sq are updated in place; grad is read only.  ``step`` is the step
    count of this update (state['step'] after torch incremented it; 1 on the first update).
    ``offset``/``full_numel`` locate the slice inside the full parameter (``full_numel``
    defaults to ``offset + n``, i.e. ``n`` for a whole parameter): torch's fused CPU kernel
    computes exp_avg_sq with a different FMA placement for the last ``full_numel % 8`` elements.
    torch's own thread count and vector width are measured to have no effect on its arithmetic
    (its elementwise scalar tails round exactly like the vector bodies), so they are not inputs.
    ``threads``: replay threads (default ``os.cpu_count()``); results do not depend on it.
    ``impl``: one of ``IMPLS`` (torch's CPU kernels) or ``CUDA_IMPLS`` (torch's CUDA kernels,
    see ``replay_step``; ``grad_scale`` only with ``"cuda-fused"``).
    """
    if impl not in _ALL_IMPLS:
        raise ValueError(f"impl must be one of {_ALL_IMPLS}, got {impl!r}")
    n = _check_buffers(param, exp_avg, exp_avg_sq, grad)
    if full_numel is None:
        full_numel = n + int(offset)
    offset, full_numel = int(offset), int(full_numel)
    if offset < 0 or full_numel < 0 or offset + n > full_numel:
        raise ValueError(f"slice [offset={offset}, offset+n={offset + n}) is not inside "
                         f"[0, full_numel={full_numel})")
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step = _check_scalars(step, **hp)
    threads = _check_threads(threads)
    _run((param, exp_avg, exp_avg_sq, grad), n, impl, decoupled, hp, step, offset, full_numel,
         threads, grad_scale or 0.0)


def _args_table(impls, decoupled, lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    """The args table of replay_batch as the records _C takes, one per entry (numpy dtype
    ``_C.REPLAY_ARGS_DTYPE``; beta powers 0, grad_mul 1, float32 gradients until the caller
    sets them); ValueError naming the entry."""
    impls = list(impls)
    if grad_scale is None:
        grad_scale = [0.0] * len(impls)
    cols = dict(decoupled=decoupled, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, step=step, grad_scale=grad_scale)
    floats = {}
    for name, col in cols.items():
        col = list(col)
        if len(col) != len(impls):
            raise ValueError(f"{name} has {len(col)} entries, expected {len(impls)} (as impls)")
        if any(isinstance(x, torch.Tensor) for x in col):
            raise ValueError(f"{name} must hold Python floats (tensor hyper-parameters "
                             f"unsupported)")
        floats[name] = col if name == "decoupled" else [float(x) for x in col]
    for k, impl in enumerate(impls):
        if impl not in _ALL_IMPLS:
            raise ValueError(f"args entry {k}: impl must be one of {_ALL_IMPLS}, "
                             f"got {impl!r}")
        if not floats["step"][k] >= 1:
            raise ValueError(f"args entry {k}: step must be >= 1 (the count after increment), "
                             f"got {floats['step'][k]}")
    floats["decoupled"] = [bool(x) for x in floats["decoupled"]]
    table = np.zeros(len(impls), _C.REPLAY_ARGS_DTYPE)
    table["impl"] = [_IMPL_CODES[impl] for impl in impls]
    for name, col in floats.items():
        table[name] = col
    table["grad_mul"] = 1.0
    return table


def _check_disjoint(p, m, v, g, nbytes, grad_item: int = 4) -> None:
    """The bytes a batch writes (param, exp_avg, exp_avg_sq of every segment) must not overlap
    each other or any grad it reads (``grad_item`` bytes per element): results would depend on
    the threads' order."""
    live = nbytes > 0
    lo = np.concatenate([p[live], m[live], v[live]])
    order = np.argsort(lo)
    lo, hi = lo[order], (lo + np.tile(nbytes[live], 3))[order]
    if (lo[1:] < hi[:-1]).any():
        raise ValueError("the param, exp_avg and exp_avg_sq ranges of the segments overlap")
    # Written ranges are sorted and disjoint: only the last one starting before a grad range's
    # end can reach into it.
    g_lo = g[live]
    k = np.searchsorted(lo, g_lo + nbytes[live] // 4 * grad_item, side="left") - 1
    if ((k >= 0) & (hi[np.maximum(k, 0)] > g_lo)).any():
        raise ValueError("a grad range overlaps a param, exp_avg or exp_avg_sq range")


def replay_batch(p, m, v, g, numel, offset, full_numel, arg, impls: Sequence[str],
                 decoupled: Sequence[bool], lr: Sequence[float], beta1: Sequence[float],
                 beta2: Sequence[float], eps: Sequence[float], weight_decay: Sequence[float],
                 step: Sequence[float], grad_scale: Optional[Sequence[float]] = None,
                 threads: Optional[int] = None, check_overlap: bool = True,
                 beta_powers: Optional[Sequence[Sequence[float]]] = None,
                 grad_dtype: torch.dtype = torch.float32,
                 grad_mul: Optional[Sequence[float]] = None) -> None:
    """Replay one Adam/AdamW update on many slices in one call, bit for bit as ``adam_replay``
    on each slice alone (``_C.adam_replay_batch``, given the args table as one record per entry).

    Segment i is ``numel[i]`` float32 elements at the host addresses ``p[i]`` (param),
    ``m[i]`` (exp_avg), ``v[i]`` (exp_avg_sq), updated in place, and ``g[i]`` (grad, read),
    being elements ``[offset[i], offset[i] + numel[i])`` of a parameter of ``full_numel[i]``
    elements (the fused CPU tail and the CUDA fused lanes depend on the global index); it is
    replayed with entry ``arg[i]`` of the args table.  p .. arg: 1-D integer numpy arrays of
    one length (addresses as ints); the caller keeps the memory alive during the call.
    The args table, lists of one length: ``impls`` (``IMPLS`` or ``CUDA_IMPLS``), ``decoupled``
    (AdamW), ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` (Python floats), ``step``
    (the count of this update, after the increment, >= 1) and ``grad_scale`` (None: none;
    per entry 0 = none, else "cuda-fused" only); ``beta_powers`` (None, or per entry the
    (beta1^t, beta2^t) a ``DEEPSPEED_IMPLS`` entry uses, (0, 0) = pow).
    ``grad_dtype`` ``torch.bfloat16``: every ``g[i]`` is bfloat16 (a bf16 gradient transport)
    and the update consumes ``float(g) * float32(grad_mul[arg[i]])`` (one float rounding, the
    training's own unscale/clip multiply; ``grad_mul`` None: 1, i.e. ``float(g)`` exactly).
    The written ranges (p, m, v of all segments) must not overlap each other or any grad range;
    grad ranges may overlap each other.  ``check_overlap=False`` skips checking that (a sort of
    3n addresses, about twice the replay's own time for 2,000 tiny segments) for a caller whose
    buffers are disjoint by construction.  ``threads``: replay threads (default
    ``os.cpu_count()``); results depend neither on it nor on how segments are cut.
    Raises ValueError, before anything is written, for bad arrays, an unknown impl, a slice
    outside its parameter, overlapping ranges or settings with no proof (naming the entry).
    """
    p, m, v, g, numel, offset, full_numel, arg = int64_arrays(
        ("p", p), ("m", m), ("v", v), ("g", g), ("numel", numel), ("offset", offset),
        ("full_numel", full_numel), ("arg", arg))
    table = _args_table(impls, decoupled, lr, beta1, beta2, eps, weight_decay, step,
                        grad_scale)
    check_non_negative("numel", numel)
    check_non_negative("offset", offset)
    bad = np.flatnonzero((offset + numel > full_numel) | (arg < 0) | (arg >= len(table)))
    if bad.size:
        i = bad[0]
        raise ValueError(f"segment {i}: slice [{offset[i]}, {offset[i] + numel[i]}) of a "
                         f"parameter of {full_numel[i]} elements with args entry {arg[i]} "
                         f"(table of {len(table)})")
    if grad_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_dtype must be torch.float32 or torch.bfloat16, got {grad_dtype}")
    grad_item = grad_dtype.itemsize
    table["grad_bf16"] = grad_dtype == torch.bfloat16
    if grad_mul is not None:
        grad_mul = [float(x) for x in grad_mul]
        if grad_dtype != torch.bfloat16 or len(grad_mul) != len(table):
            raise ValueError("grad_mul: one float per args entry, with a bfloat16 grad_dtype")
        if any(float(np.float32(x)) != x for x in grad_mul):
            raise ValueError("grad_mul: each must be a float32 value (the multiplier's bits)")
        table["grad_mul"] = grad_mul
    if beta_powers is not None:
        powers = [(float(b[0]), float(b[1])) for b in beta_powers]
        if len(powers) != len(table):
            raise ValueError(f"beta_powers has {len(powers)} entries, expected {len(table)} "
                             f"(one (beta1^t, beta2^t) per args entry)")
        table["beta1_power"] = [b[0] for b in powers]
        table["beta2_power"] = [b[1] for b in powers]
    addrs = np.stack([p, m, v])[:, numel > 0]
    if ((addrs == 0) | (addrs & 3 != 0)).any() or \
            ((g[numel > 0] == 0) | (g[numel > 0] % grad_item != 0)).any():
        raise ValueError("every address of a non-empty segment must be non-zero and aligned "
                         "to its element (float32; the gradient's dtype)")
    if check_overlap:
        _check_disjoint(p, m, v, g, 4 * numel, grad_item)
    _C.adam_replay_batch(p, m, v, g, numel, offset, full_numel, arg, table,
                         _check_threads(threads))


def replay_arithmetics() -> list:
    """Names of the arithmetic profiles ``replay_step`` reproduces bit for bit, sorted.

    ``"<device>/<source>/<optimizer>/<impl>"``: ``cpu/torch/{Adam,AdamW}/{single,foreach,fused}``
    (torch's CPU kernels, checked against torch itself) and
    ``cuda/torch/{Adam,AdamW}/{forloop,foreach,fused}`` (torch >= 2.11 CUDA kernels, proven on
    golden vectors recorded on an NVIDIA H100), and
    ``cpu/deepspeed/FusedAdam/adam_w_mode={True,False}`` (DeepSpeed's CPU Adam op, checked against
    the op itself).  Profiles recorded but not reproducible (DeepSpeed FusedAdam on CUDA) are not
    listed and are refused.
    """
    return sorted(_PROFILES)


def _profile(arithmetic: str):
    if arithmetic not in _PROFILES:
        raise ValueError(f"unknown arithmetic {arithmetic!r}; known: "
                         f"{', '.join(replay_arithmetics())}")
    return _PROFILES[arithmetic]


def replay_step(arithmetic: str, param, exp_avg, exp_avg_sq, grad, *, lr: float, betas,
                eps: float, weight_decay: float, step, grad_scale: Optional[float] = None,
                beta_powers=None, simd_width: Optional[int] = None, tensors=None) -> None:
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
    DeepSpeed's CPU op (``cpu/deepspeed/FusedAdam/adam_w_mode=...``, also what
    ``DeepSpeedCPUAdam`` runs) keeps ``beta1^t``, ``beta2^t`` as float32 running products in
    the process: ``beta_powers`` gives them (default: ``pow(beta, step)`` rounded to float, what
    the op uses when t jumps); ``simd_width`` is the float32 lanes the op was built with
    (default: :func:`deepspeed_simd_width`), which decides the elements of its scalar tail.
    ``tensors``: the state tensors to replay, all three (None, the default) or the moments
    ``("exp_avg", "exp_avg_sq")``; the others are left as they are.  Each must be one the
    profile reproduces for this parameter (:func:`gockpt.replay.claims.replay_claims`: e.g.
    DeepSpeed's CUDA FusedAdam reproduces its moments, not its parameter line).
    Raises ValueError for an unknown or unproven arithmetic, a tensor it does not reproduce
    (naming it and why), bad tensors, or a setting the profile has no proof for
    (docs/arithmetics.md says which).
    """
    impl, decoupled = _profile(arithmetic)
    if impl == "deepspeed-cpu":
        width = deepspeed_simd_width() if simd_width is None else int(simd_width)
        if width not in (1, 8, 16):
            raise ValueError(f"simd_width must be 1, 8 or 16, got {simd_width!r}")
        impl = f"deepspeed-cpu-w{width}"
    elif beta_powers is not None or simd_width is not None:
        raise ValueError(f"beta_powers and simd_width are taken by DeepSpeed's CPU arithmetic "
                         f"only, not by {arithmetic!r}")
    if grad_scale is not None and impl != "cuda-fused":
        raise ValueError(f"grad_scale is taken only by the CUDA fused arithmetics, not by "
                         f"{arithmetic!r}")
    if grad_scale is not None and not float(grad_scale) > 0:
        raise ValueError(f"grad_scale must be a positive float, got {grad_scale!r}")
    n = _check_buffers(param, exp_avg, exp_avg_sq, grad, flat_only=False)
    wanted = check_tensors(arithmetic, tensors, n, weight_decay)
    beta1, beta2 = betas
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if "param" not in wanted and impl != DEEPSPEED_CUDA_MOMENTS:
        param = param.detach().clone()  # the kernel writes a parameter: a scratch one, dropped
        hp["weight_decay"] = moments_weight_decay(decoupled, weight_decay)
    step = _check_scalars(step, **hp)
    powers = (0.0, 0.0) if beta_powers is None else tuple(float(b) for b in beta_powers)
    if not all(0 <= b <= 1 for b in powers):
        raise ValueError(f"beta_powers must be two floats in (0, 1], got {beta_powers!r}")
    _run((param, exp_avg, exp_avg_sq, grad), n, impl, decoupled, hp, step, 0, n,
         os.cpu_count() or 1, grad_scale or 0.0, powers)
