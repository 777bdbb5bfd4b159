"""The optimizer state codec: how the small per-parameter state of an optimizer (Adam's step
counters) is gathered by key into columns when a checkpoint takes it (:func:`optimizer_small`),
and put back in place when one is loaded (:func:`expand_columns`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import _tensors
from .lists import PlainInts

_DTYPE = operator.attrgetter("dtype")


def expand_columns(small: dict) -> dict:
    """The per-parameter state of a decoded optimizer small section, with the gathered
    scalar columns (see :func:`optimizer_small`) put back in place as 0-dim
    tensors of their own."""
    state = small["state"]
    for key, groups in (small.get("columns") or {}).items():
        for group in groups:
            values = group["values"]
            if len(group["index"]) != values.numel():
                raise ValueError(f"scalar column {key!r}: {len(group['index'])} indices for "
                                 f"{values.numel()} values")
            for i, idx in enumerate(group["index"]):
                state.setdefault(idx, {})[key] = values[i].clone()
    return state


@dataclass(frozen=True)
class KnownStates:
    """The optimizer state as a caller's plan knows it (:func:`optimizer_small` then walks
    neither ``optimizer.state_dict()`` nor ``optimizer.state`` by parameter)."""

    indices: List[int]
    """The state index of every parameter with state, as ``state_dict()`` numbers them."""
    dicts: List[dict]
    """Its state dict, at the same place."""
    group_indices: List[List[int]]
    """Each param group's state indices."""
    aligned: Optional[tuple] = None
    """The aligned keys, when every state index has the same (else None)."""
    read: dict = field(default_factory=dict, compare=False)
    """What the last :func:`optimizer_small` read of ``dicts`` (their keys, each kept key's
    values) and the :class:`gockpt._tensors.DictVersions` that says whether it still holds."""


def optimizer_small(optimizer: torch.optim.Optimizer, aligned_keys,
                    known: Optional[KnownStates] = None) -> dict:
    """``optimizer.state_dict()`` without the aligned per-element state (which travels as
    blocks): param groups, step counts and any other small state, copied (frozen at this
    version).

    Scalar state (0-dim tensors: Adam's step counters) is gathered per key and dtype into one
    tensor with one stack -- one copy from a GPU, one stored value -- under ``"columns"``:
    ``{key: [{"index": [state index, ...], "values": 1-D tensor}, ...]}``;
    :func:`gockpt.core.optstate.expand_columns` puts them back in place.

    ``aligned_keys``: state index -> the keys that travel as blocks. ``known``: used instead
    of asking ``optimizer.state_dict()`` (a walk over every parameter) when that method is
    torch's own, with no hook, and ``optimizer.state`` holds nothing else."""
    if known is not None and _plain_optimizer(optimizer) and \
            len(optimizer.state) == len(known.indices) and \
            len(known.group_indices) == len(optimizer.param_groups):
        param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": PlainInts(index)}  # (a plan's indices: plain ints)
                        for g, index in zip(optimizer.param_groups, known.group_indices)]
        columns = _uniform_columns(known)
        if columns is not None:
            return {"state": {}, "columns": columns, "param_groups": param_groups}
        items = list(zip(known.indices, known.dicts))
    else:
        sd = optimizer.state_dict()
        items, param_groups = sd["state"].items(), sd["param_groups"]
    state, gathered = {}, {}
    for keys, entries in _by_keys(items, aligned_keys).items():
        for key in keys:
            values = [st[key] for _, st in entries]
            dtypes = set(map(_DTYPE, values)) if set(map(type, values)) == {torch.Tensor} \
                else ()
            if len(dtypes) == 1:  # the usual case: checked as a whole when stacked below
                group = gathered.setdefault((key, dtypes.pop()), ([], []))
                group[0].extend(idx for idx, _ in entries)
                group[1].extend(values)
            else:
                _place(state, gathered, key, [idx for idx, _ in entries], values)
    columns = {}
    for (key, _), (index, values) in gathered.items():
        column = _tensors.stack_scalars(values)  # 0-dim on the CPU: one C++ pass
        if column is None:
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


def _uniform_columns(known: KnownStates) -> Optional[dict]:
    """The columns of the usual case, in a few C++ passes: every state dict with the same
    keys, the same aligned keys, and every other value a 0-dim CPU tensor of one dtype per
    key (Adam's steps). None otherwise (the general walk decides). The dicts' keys and values
    are read again only where some dict changed since the last call (``known.read``)."""
    if known.aligned is None:
        return None
    read = known.read
    seen = read.get("versions")
    if seen is None:
        seen = read["versions"] = _tensors.DictVersions()
    if not seen.same(known.dicts) or "values" not in read:  # (else: the very same values)
        keys = _tensors.same_keys(known.dicts)
        read["values"] = None if keys is None else \
            {key: _tensors.values(known.dicts, key) for key in _kept((keys, known.aligned))}
    if read["values"] is None:
        return None
    columns = {}
    for key, values in read["values"].items():
        column = _tensors.stack_scalars(values)  # (their values now: changed in place)
        if column is None:
            return None
        columns[key] = [{"index": PlainInts(known.indices), "values": column}]
    return columns


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
