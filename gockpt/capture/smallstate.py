"""Everything small that changes every step, captured at the boundary of version F:
model buffers, optimizer scalars and param groups, the LR scheduler, RNG states, the user's
step and extra state. Large tensors (parameters and aligned optimizer state) are not here:
they travel as blocks."""

from __future__ import annotations

import random
from typing import Dict, Iterable, List, Optional, Set

import numpy as np
import torch

from .. import _tensors
from ..core.names import MODULE_WRAPPERS, WRAPPED_CHILDREN, Names


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


def fresh_ids(rng: dict, optimizer: dict) -> Set[int]:
    """The id()s of what :func:`capture_rng` and ``optimizer_small`` (``{}``: none) made for
    one checkpoint or log entry, held nowhere else: the RNG states' tensors and key array, the
    optimizer's step columns (each a copy of its own: encoded without another)."""
    fresh = {id(rng["torch"]), *map(id, rng.get("cuda", ()))}
    numpy = rng["numpy"]
    if isinstance(numpy, tuple) and len(numpy) > 1 and isinstance(numpy[1], np.ndarray):
        fresh.add(id(numpy[1]))
    for parts in optimizer.get("columns", {}).values():
        fresh.update(id(part["values"]) for part in parts)
    return fresh


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


def model_small(model: torch.nn.Module, planned_ids: Iterable[int],
                walks: Optional[_tensors.ModuleWalkCache] = None) -> Dict[str, object]:
    """``model.state_dict()`` without the planned parameters (buffers, extra states, and any
    tensor the plan does not carry), under the names without wrapper prefixes
    (:mod:`gockpt.core.names`). Tensors are cloned: the result is frozen at this version.
    ``walks``: the caller's walk of this model, kept while nothing it read has changed."""
    planned = planned_ids if isinstance(planned_ids, dict) \
        else dict.fromkeys(planned_ids)  # (a dict keyed by them is used as it is)
    entries = _plain_entries(model, planned, walks)
    if entries is None:  # a hook or an override may change what state_dict() holds: ask it
        names = Names(model)
        entries = [(names.clean(name), value)
                   for name, value in model.state_dict(keep_vars=True).items()
                   if not (isinstance(value, torch.Tensor) and id(value) in planned)]
    return {name: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor)
            else value for name, value in entries}


_PLAIN_CLASSES: Dict[type, bool] = {}
_STATE_DICT_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")


def _plain_entries(model: torch.nn.Module, planned: dict,
                   walks: Optional[_tensors.ModuleWalkCache] = None) -> Optional[List[tuple]]:
    """(name, tensor) of what ``model.state_dict(keep_vars=True)`` holds outside ``planned``
    (a dict keyed by ``id()``), in its order, read from the modules' own dicts in one C++ walk
    (``state_dict()`` costs about three times more per module, a Python walk about twice);
    None when some module's class overrides how its state is saved, or it has state_dict
    hooks (then only ``state_dict()`` itself knows). ``walks``: a walk kept from the last
    call, taken again only where something it read has changed."""
    walk = _tensors.module_entries if walks is None else walks.entries
    while True:
        out = walk(model, planned, _PLAIN_CLASSES, WRAPPED_CHILDREN, MODULE_WRAPPERS)
        if not isinstance(out, type):
            return out
        _PLAIN_CLASSES[out] = all(getattr(out, name) is getattr(torch.nn.Module, name)
                                  for name in _STATE_DICT_METHODS)


def scheduler_state(scheduler) -> Optional[dict]:
    return None if scheduler is None else scheduler.state_dict()
