"""Tools to prove a resume is bitwise: snapshot the live training state, compare two snapshots.

    before = gockpt.testing.snapshot(model, optimizer, scheduler)   # at step N of a run
    ...                                                              # crash, gockpt.load(...)
    gockpt.testing.assert_same(before, gockpt.testing.snapshot(model, optimizer, scheduler))

A snapshot is deep-copied CPU state: the model's and the optimizer's ``state_dict``, the
scheduler's, and the RNG states gockpt restores (torch CPU, CUDA where initialised, numpy,
Python's ``random``). It holds only tensors, plain containers and scalars, so
``torch.save`` / ``torch.load(weights_only=True)`` carry it between processes unchanged.

Comparisons are exact: tensors byte for byte (``-0.0`` differs from ``0.0``, a NaN equals
the same NaN), floats by their bits, and every container and scalar must have the same type
(a tuple is not a list, ``1`` is not ``1.0`` or ``True``).
"""

from __future__ import annotations

import random
import struct
from typing import Any, Optional

import numpy as np
import torch

from .core.memory import local

__all__ = ["snapshot", "first_difference", "assert_same"]


def snapshot(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             scheduler=None) -> dict:
    """Deep-copied CPU state of a training run: ``{"model", "optimizer", "scheduler", "rng"}``
    (of a DTensor -- FSDP2 -- this rank's local shard).

    ``optimizer`` and ``scheduler`` are None when not given; ``rng`` holds ``torch``,
    ``numpy`` (``[name, keys as an int64 tensor, pos, has_gauss, cached_gaussian]``),
    ``python`` and, where CUDA is initialised, ``cuda`` (one state per device). Nothing in
    it shares memory with the live objects."""
    return {
        "model": _cpu_copy(model.state_dict()),
        "optimizer": None if optimizer is None else _cpu_copy(optimizer.state_dict()),
        "scheduler": None if scheduler is None else _cpu_copy(scheduler.state_dict()),
        "rng": _rng_states(),
    }


def _rng_states() -> dict:
    """The RNG states gockpt captures, in a form ``torch.load(weights_only=True)`` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {"torch": torch.get_rng_state(),
           "numpy": [str(name), torch.from_numpy(keys.astype(np.int64)), int(pos),
                     int(has_gauss), float(cached)],
           "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return rng


def _cpu_copy(obj):
    """``obj`` with every tensor cloned to the CPU and every container copied."""
    if isinstance(obj, torch.Tensor):  # a DTensor (FSDP2): this rank's local shard
        return local(obj).detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        copied = [_cpu_copy(v) for v in obj]
        if type(obj) in (list, tuple):
            return type(obj)(copied)
        return type(obj)(*copied)  # a namedtuple
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return obj  # scalars, strings, None: immutable


def first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None if ``a`` and ``b`` are identical bit for bit, else where and how they first differ,
    e.g. ``"optimizer['state'][0]['exp_avg']: 3 of 64 elements differ"``.

    Walks dicts (same keys), lists and tuples (same type and length), tensors and numpy arrays
    (same dtype, shape and bytes) and scalars (same type; floats by their bits)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, path)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _array_difference(a, b, path)
    if isinstance(a, dict) or isinstance(b, dict):
        return _dict_difference(a, b, path)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return _sequence_difference(a, b, path)
    return _scalar_difference(a, b, path)


def assert_same(a: Any, b: Any, msg: str = "") -> None:
    """Raise AssertionError naming the first difference unless ``a`` and ``b`` are identical
    bit for bit (see :func:`first_difference`); ``msg`` prefixes the message."""
    diff = first_difference(a, b)
    if diff is not None:
        raise AssertionError(f"{msg}: {diff}" if msg else diff)


def _where(path: str) -> str:
    return path or "value"


def _tensor_difference(a, b, path: str) -> Optional[str]:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{_where(path)}: {type(a).__name__} vs {type(b).__name__}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{_where(path)}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.numel() == 0:
        return None
    # One row of raw bytes per element: exact for every dtype, NaN payloads and -0.0 included.
    ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    n = int((ab != bb).any(dim=1).sum())
    return f"{_where(path)}: {n} of {a.numel()} elements differ" if n else None


def _array_difference(a, b, path: str) -> Optional[str]:
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return f"{_where(path)}: {type(a).__name__} vs {type(b).__name__}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{_where(path)}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.tobytes() != b.tobytes():
        return f"{_where(path)}: numpy arrays differ"
    return None


def _dict_difference(a, b, path: str) -> Optional[str]:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return f"{_where(path)}: {type(a).__name__} vs {type(b).__name__}"
    if set(a) != set(b):
        return (f"{_where(path)}: keys differ, only in the first {_keys(set(a) - set(b))}, "
                f"only in the second {_keys(set(b) - set(a))}")
    for key in a:
        diff = first_difference(a[key], b[key], f"{path}[{key!r}]")
        if diff is not None:
            return diff
    return None


def _keys(keys) -> str:
    shown = sorted(map(repr, keys))
    return "[" + ", ".join(shown[:6]) + (", ..." if len(shown) > 6 else "") + "]"


def _sequence_difference(a, b, path: str) -> Optional[str]:
    if type(a) is not type(b):
        return f"{_where(path)}: {type(a).__name__} vs {type(b).__name__}"
    if len(a) != len(b):
        return f"{_where(path)}: length {len(a)} vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        diff = first_difference(x, y, f"{path}[{i}]")
        if diff is not None:
            return diff
    return None


def _scalar_difference(a, b, path: str) -> Optional[str]:
    if type(a) is not type(b):
        return f"{_where(path)}: {type(a).__name__} {a!r:.60} vs {type(b).__name__} {b!r:.60}"
    if isinstance(a, float):
        same = struct.pack("<d", a) == struct.pack("<d", b)
    elif isinstance(a, np.generic):
        same = a.dtype == b.dtype and a.tobytes() == b.tobytes()
    else:
        same = a == b
    return None if same else f"{_where(path)}: {a!r:.60} != {b!r:.60}"
