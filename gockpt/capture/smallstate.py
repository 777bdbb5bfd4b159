"""Everything small that changes every step, captured at the boundary of version F:
model buffers, optimizer scalars and param groups, the LR scheduler, RNG states, the user's
step and extra state. Large tensors (parameters and aligned optimizer state) are not here:
they travel as blocks."""

from __future__ import annotations

import random
from typing import Dict, Iterable, Optional

import numpy as np
import torch


def capture_rng() -> dict:
    """RNG states of torch (CPU and CUDA where initialised), numpy and Python's random."""
    rng = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def model_small(model: torch.nn.Module, planned_ids: Iterable[int]) -> Dict[str, object]:
    """``model.state_dict()`` without the planned parameters (buffers, extra states, and any
    tensor the plan does not carry). Tensors are cloned: the result is frozen at this version."""
    planned = set(planned_ids)
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            if id(value) in planned:
                continue
            out[name] = value.detach().to("cpu", copy=True)
        else:
            out[name] = value
    return out


def optimizer_small(optimizer: torch.optim.Optimizer, aligned_keys) -> dict:
    """``optimizer.state_dict()`` without the aligned per-element state (which travels as
    blocks): param groups, step counts and any other small state, copied (frozen at this
    version).

    Scalar state (0-dim tensors: Adam's step counters) is gathered per key and dtype into one
    tensor with one stack -- one copy from a GPU, one stored value -- under ``"columns"``:
    ``{key: [{"index": [state index, ...], "values": 1-D tensor}, ...]}``;
    :func:`gockpt.storage.manifest.expand_columns` puts them back in place."""
    sd = optimizer.state_dict()
    state, gathered, none = {}, {}, ()
    for idx, st in sd["state"].items():
        skip = aligned_keys.get(idx, none)
        for key, value in st.items():
            if key in skip:
                continue
            if type(value) is torch.Tensor and value.dim() == 0:  # (state holds no grad)
                group = gathered.get((key, value.dtype, value.device))
                if group is None:
                    group = gathered[(key, value.dtype, value.device)] = ([], [])
                group[0].append(idx)
                group[1].append(value)
            else:
                state.setdefault(idx, {})[key] = value.detach().to("cpu", copy=True) \
                    if isinstance(value, torch.Tensor) else value
    columns = {}
    for (key, _, _), (index, values) in gathered.items():
        columns.setdefault(key, []).append({"index": index,
                                            "values": torch.stack(values).to("cpu")})
    return {"state": state, "columns": columns, "param_groups": sd["param_groups"]}


def scheduler_state(scheduler) -> Optional[dict]:
    return None if scheduler is None else scheduler.state_dict()
