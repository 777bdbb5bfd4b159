"""Checks of the segment tables handed to the C++ core: 1-D integer numpy arrays of one length,
passed on as C-contiguous int64 (addresses as ints).  The C++ side casts whatever it gets, so a
float array of addresses would be truncated silently: it is refused here, with the array's name.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np


def int64_arrays(*named: Tuple[str, object]) -> List[np.ndarray]:
    """``named``: (name, array) pairs; returns the arrays as int64, all of the first's length.

    Raises ValueError for a non-1-D or non-integer array (an empty one may have any dtype, as
    ``np.asarray([])`` is float) or a length that differs from the first array's.
    """
    out = []
    for name, a in named:
        arr = np.asarray(a)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
        out.append(np.ascontiguousarray(arr, dtype=np.int64))
    first, n = named[0][0], len(out[0])
    for (name, _), arr in zip(named, out):
        if len(arr) != n:
            raise ValueError(f"{name} has {len(arr)} elements, expected {n} (as {first})")
    return out


def check_non_negative(name: str, arr: np.ndarray) -> None:
    """ValueError naming the first negative element of ``arr``."""
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] is negative ({arr[bad[0]]})")
