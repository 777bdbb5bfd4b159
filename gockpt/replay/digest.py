"""Digest of a float32 tensor's bit patterns, computed identically on the host (C++) and on any
torch device (int64 tensor ops): a replayed host block is verified against the live training
tensor at step F by comparing digests, without copying the tensor.

For the n float32 elements of a tensor as uint32 words ``w_i`` (zero-extended to 64 bits), the
element with index ``idx_i = first + i`` (its index in the whole parameter):

    d1 = sum_i w_i * (2*idx_i + 1)                            (mod 2**64)
    d2 = sum_i w_i * ((idx_i * DIGEST_MULTIPLIER) | 1)        (mod 2**64, the product wraps)

Every weight is odd, hence invertible modulo 2**64: changing one word by delta (0 < |delta| <
2**32) changes d1 by delta * weight, which is not 0 mod 2**64, so any single changed word -- a
flipped bit, a NaN payload, -0.0 for 0.0 -- changes d1 (and d2).  The index weighting makes
swapped elements visible, and d2's weights (multiplicative hashing of the index) make two
compensating changes in different places unlikely to cancel in both sums.  Integer addition
is order-independent, so the sum is exact whatever the reduction order of a GPU, and a tensor's
digest is the (wrapping) sum of its slices' digests taken with the slices' own ``first``.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch

from gockpt import _C
from gockpt._arrays import check_non_negative, int64_arrays

__all__ = ["DIGEST_MULTIPLIER", "digest", "digest_torch", "digest_segments"]

# 0x9E3779B97F4A7C15 (2**64 / golden ratio, odd) as the signed int64 torch multiplies by.
DIGEST_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
_MASK64 = (1 << 64) - 1
# digest_torch works on this many elements at a time: its int64 temporaries stay bounded.
_TORCH_CHUNK = 1 << 22


def _check_tensor(t, first: int, device_cpu: bool) -> int:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"the digest is defined on float32 tensors, got {t.dtype}")
    if device_cpu and t.device.type != "cpu":
        raise ValueError(f"digest() reads host memory; use digest_torch() on {t.device}")
    if not t.is_contiguous():
        raise ValueError("the tensor must be contiguous (its words in element order)")
    if int(first) < 0:
        raise ValueError(f"first must be >= 0, got {first}")
    return t.numel()


def digest(t: torch.Tensor, first: int = 0) -> Tuple[int, int]:
    """(d1, d2) of a contiguous float32 CPU tensor whose element 0 has index ``first`` (C++)."""
    n = _check_tensor(t, first, device_cpu=True)
    return _C.digest(t.data_ptr(), n, int(first))


def digest_torch(t: torch.Tensor, first: int = 0) -> Tuple[int, int]:
    """(d1, d2) of a contiguous float32 tensor on any device, with torch int64 ops only: what a
    CUDA device runs on the live tensor.  Equal to ``digest(t.cpu(), first)``."""
    n = _check_tensor(t, first, device_cpu=False)
    words = t.reshape(-1).view(torch.int32)
    d1 = d2 = 0
    for b in range(0, n, _TORCH_CHUNK):
        w = words[b:b + _TORCH_CHUNK].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(first + b, first + b + w.numel(), dtype=torch.int64, device=t.device)
        d1 += int((w * (2 * idx + 1)).sum())
        d2 += int((w * ((idx * DIGEST_MULTIPLIER) | 1)).sum())
    return d1 & _MASK64, d2 & _MASK64


def digest_segments(src, nwords, first, threads: Optional[int] = None) -> np.ndarray:
    """Digests of many host segments in one call: segment i is ``nwords[i]`` words (float32
    elements) at address ``src[i]`` whose first has index ``first[i]`` (1-D integer numpy
    arrays of one length).  Returns a uint64 array of shape (n, 2): row i is (d1, d2).
    ``threads``: default ``os.cpu_count()``."""
    src, nwords, first = int64_arrays(("src", src), ("nwords", nwords), ("first", first))
    check_non_negative("nwords", nwords)
    check_non_negative("first", first)
    out = np.empty(2 * len(src), dtype=np.uint64)
    threads = (os.cpu_count() or 1) if threads is None else int(threads)
    _C.digest_batch(src, nwords, first, out, threads)
    return out.reshape(-1, 2)


def block_digests_torch(flat: torch.Tensor, block: int, window: int = _TORCH_CHUNK) -> torch.Tensor:
    """Digests of every ``block``-element block of the 1-D float32 tensor ``flat`` (the last one
    shorter; element indices from 0), with torch int64 ops on ``flat``'s device -- one pass
    per window of blocks, no synchronisation: an (nblocks, 2) int64 tensor on that device whose
    bits are the (d1, d2) of each block (``.cpu().numpy().view(np.uint64)``)."""
    n = flat.numel()
    nb = -(-n // block)
    out = torch.empty(nb, 2, dtype=torch.int64, device=flat.device)
    words = flat.view(torch.int32)
    per = max(1, window // block)
    for b0 in range(0, nb, per):
        b1 = min(nb, b0 + per)
        lo, hi = b0 * block, min(n, b1 * block)
        w = words[lo:hi].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(lo, hi, dtype=torch.int64, device=flat.device)
        pad = (b1 - b0) * block - (hi - lo)  # zero words add nothing
        for lane, weight in enumerate((2 * idx + 1, (idx * DIGEST_MULTIPLIER) | 1)):
            terms = torch.nn.functional.pad(w * weight, (0, pad)) if pad else w * weight
            out[b0:b1, lane] = terms.view(b1 - b0, block).sum(1)
    return out
