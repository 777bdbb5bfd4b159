"""Everything small that changes every step, captured at the boundary of version F:
model buffers, optimizer scalars and param groups, the LR scheduler, RNG states, the user's
step and extra state. Large tensors (parameters and aligned optimizer state) are not here:
they travel as blocks."""

from __future__ import annotations

import random
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch

from ..core.names import Names, is_wrapper_child


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


def check_rng(rng) -> None:
    """Raise (TypeError, ValueError, ...) unless ``rng`` is a state :func:`restore_rng` takes,
    tried on generators of their own: the process's RNGs are not touched."""
    if not isinstance(rng, dict) or not {"torch", "numpy", "python"} <= set(rng):
        raise ValueError("the RNG state lacks torch, numpy or python")
    torch.Generator().set_state(rng["torch"])
    np.random.RandomState().set_state(rng["numpy"])
    random.Random().setstate(rng["python"])
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and
                                            t.dtype == torch.uint8 for t in cuda):
        raise ValueError("the CUDA RNG states are not a list of uint8 tensors")


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def model_small(model: torch.nn.Module, planned_ids: Iterable[int]) -> Dict[str, object]:
    """``model.state_dict()`` without the planned parameters (buffers, extra states, and any
    tensor the plan does not carry), under the names without wrapper prefixes
    (:mod:`gockpt.core.names`). Tensors are cloned: the result is frozen at this version."""
    planned = planned_ids if isinstance(planned_ids, (set, frozenset, dict)) \
        else set(planned_ids)  # (a set or a dict keyed by them is used as it is)
    entries = _plain_entries(model, planned)
    if entries is None:  # a hook or an override may change what state_dict() holds: ask it
        names = Names(model)
        entries = [(names.clean(name), value)
                   for name, value in model.state_dict(keep_vars=True).items()
                   if not (isinstance(value, torch.Tensor) and id(value) in planned)]
    return {name: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor)
            else value for name, value in entries}


_PLAIN_CLASSES: Dict[type, bool] = {}
_STATE_DICT_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")


def _plain_entries(model: torch.nn.Module, planned: set) -> Optional[List[tuple]]:
    """(name, tensor) of what ``model.state_dict(keep_vars=True)`` holds outside ``planned``,
    in its order, read from the modules directly (``state_dict()`` costs about three times
    more per module); None when some module's class overrides how its state is saved, or it
    has state_dict hooks (then only ``state_dict()`` itself knows)."""
    out: List[tuple] = []
    stack = [("", model)]
    while stack:
        prefix, m = stack.pop()
        plain = _PLAIN_CLASSES.get(type(m))
        if plain is None:
            plain = _PLAIN_CLASSES[type(m)] = all(
                getattr(type(m), name) is getattr(torch.nn.Module, name)
                for name in _STATE_DICT_METHODS)
        if not plain or m._state_dict_hooks or m._state_dict_pre_hooks:
            return None
        for name, p in m._parameters.items():
            if p is not None and id(p) not in planned:
                out.append((prefix + name, p))
        if m._buffers:
            transient = m._non_persistent_buffers_set
            out.extend((prefix + name, b) for name, b in m._buffers.items()
                       if b is not None and name not in transient)
        if m._modules:  # depth first, in registration order (as state_dict() walks)
            stack.extend(reversed([(prefix if is_wrapper_child(m, name) else
                                    prefix + name + ".", c) for name, c in m._modules.items()
                                   if c is not None]))
    return out


def optimizer_small(optimizer: torch.optim.Optimizer, aligned_keys, known=None) -> dict:
    """``optimizer.state_dict()`` without the aligned per-element state (which travels as
    blocks): param groups, step counts and any other small state, copied (frozen at this
    version).

    Scalar state (0-dim tensors: Adam's step counters) is gathered per key and dtype into one
    tensor with one stack -- one copy from a GPU, one stored value -- under ``"columns"``:
    ``{key: [{"index": [state index, ...], "values": 1-D tensor}, ...]}``;
    :func:`gockpt.core.optstate.expand_columns` puts them back in place.

    ``known``: ([(state index, state dict), ...] of every parameter with state, [each param
    group's state indices]) as the caller's plan has them: used instead of asking
    ``optimizer.state_dict()`` (a walk over every parameter) when that method is torch's own,
    with no hook, and ``optimizer.state`` holds nothing else."""
    if known is not None and _plain_optimizer(optimizer) and \
            len(optimizer.state) == len(known[0]) and len(known[1]) == len(optimizer.param_groups):
        items = known[0]
        param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(index)}
                        for g, index in zip(optimizer.param_groups, known[1])]
    else:
        sd = optimizer.state_dict()
        items, param_groups = sd["state"].items(), sd["param_groups"]
    state, gathered = {}, {}
    for keys, entries in _by_keys(items, aligned_keys).items():
        for key in keys:
            values = [st[key] for _, st in entries]
            dtypes = {v.dtype for v in values} if set(map(type, values)) == {torch.Tensor} \
                else ()
            if len(dtypes) == 1:  # the usual case: checked as a whole when stacked below
                group = gathered.setdefault((key, dtypes.pop()), ([], []))
                group[0].extend(idx for idx, _ in entries)
                group[1].extend(values)
            else:
                _place(state, gathered, key, [idx for idx, _ in entries], values)
    columns = {}
    for (key, _), (index, values) in gathered.items():
        try:
            column = torch.stack(values)  # refuses other shapes and mixed devices
        except RuntimeError:
            column = None
        if column is None or column.dim() != 1:  # not all 0-dim, or on several devices
            split: dict = {}
            _place(state, split, key, index, values)
            for sub_index, sub_values in split.values():
                columns.setdefault(key, []).append(
                    {"index": sub_index, "values": torch.stack(sub_values).to("cpu")})
            continue
        columns.setdefault(key, []).append({"index": index, "values": column.to("cpu")})
    return {"state": state, "columns": columns, "param_groups": param_groups}


def _place(state: dict, gathered: dict, key: str, index: list, values: list) -> None:
    """One by one: 0-dim tensors into ``gathered`` by (key, (dtype, device)), anything else
    copied into ``state``."""
    for idx, value in zip(index, values):
        if type(value) is torch.Tensor and value.dim() == 0:  # (state holds no grad)
            group = gathered.setdefault((key, (value.dtype, value.device)), ([], []))
            group[0].append(idx)
            group[1].append(value)
        else:
            state.setdefault(idx, {})[key] = value.detach().to("cpu", copy=True) \
                if isinstance(value, torch.Tensor) else value


def _by_keys(items, aligned_keys) -> Dict[tuple, list]:
    """The (state index, state dict) pairs grouped by the keys they keep (their keys less the
    aligned ones): Adam's thousands of states fall in one or two groups, walked key by key.
    The usual case -- every state with the same keys and the same aligned keys -- is found
    by two C-level counts, not a Python step per state."""
    items = list(items)
    if not items:
        return {}
    keys = list(map(tuple, [st for _, st in items]))
    skips = list(map(aligned_keys.get, [idx for idx, _ in items]))
    if keys.count(keys[0]) == len(keys) and skips.count(skips[0]) == len(skips):
        return {_kept((keys[0], skips[0])): items}
    out: Dict[tuple, list] = {}
    kept: Dict[tuple, tuple] = {}
    for entry, sig in zip(items, zip(keys, skips)):
        if sig not in kept:
            kept[sig] = _kept(sig)
        out.setdefault(kept[sig], []).append(entry)
    return out


def _kept(sig: tuple) -> tuple:
    """(a state's keys, its aligned keys or None) -> the keys kept in the small state."""
    keys, aligned = sig
    return tuple(k for k in keys if k not in (aligned or ()))


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.state_dict()`` is torch's own, with no hook to change it."""
    return (type(optimizer).state_dict is torch.optim.Optimizer.state_dict
            and not getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
            and not getattr(optimizer, "_optimizer_state_dict_post_hooks", None))


def scheduler_state(scheduler) -> Optional[dict]:
    return None if scheduler is None else scheduler.state_dict()
