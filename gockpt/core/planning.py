"""How a :class:`~gockpt.core.plan.Plan` is made from a model and its optimizer, and checked
against them later: the slots found from the optimizer's param groups and the model's names,
the blocks cut (:func:`build_plan`); which slots the ranks hold alike or as slices of a global
tensor (:func:`mark_parallel`); the param groups an optimizer step is about to step
(:func:`fingerprint`, :func:`stepped_groups`); the parameters' layouts (:func:`check_layouts`).
The plan itself (plan.py) is data: it reads no model or optimizer."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import _tensors
from .blocks import Block
from .errors import ConfigError, LayoutChangedError
from .memory import layout_of, replicas_of
from .names import Names
from .plan import Plan, Slot


def build_plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               block_bytes: int, min_blocks: int = 1, ranks: int = 1,
               want_blocks: int = 1) -> Plan:
    """Map the optimizer's parameters to model names and cut everything into blocks of
    ``block_bytes`` -- smaller where the optimized parameters would otherwise make fewer than
    ``min_blocks`` blocks (an explicit K needs K groups: one flat partition of DeepSpeed's
    would be one block; ConfigError where they have fewer elements), or than ``want_blocks``
    as far as they have elements (a K measured later can be up to that), or, as far as they
    have elements, fewer than that per rank of ``ranks`` (replicas split the blocks into
    shares: each share needs K groups too)."""
    canonical: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    names = Names(model)  # stored without wrapper prefixes (DDP's module., compile's _orig_mod.)
    for name, p in model.named_parameters(remove_duplicate=False):
        name = names.clean(name)
        if id(p) in canonical:
            aliases[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name

    slots: List[Slot] = []
    seen = set()
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in canonical:
                raise ConfigError(
                    f"model/optimizer mismatch: parameter #{index} of the optimizer (param group "
                    f"{gi}, shape {tuple(p.shape)}) is not a parameter of the model; build the "
                    "optimizer from model.parameters() of the model passed to the Checkpointer")
            slots.append(Slot(canonical[id(p)], p, index, gi, dims=layout_of(canonical[id(p)], p)))
            seen.add(id(p))
            index += 1
    for name, p in model.named_parameters():
        name = names.clean(name)
        if id(p) not in seen:
            slots.append(Slot(name, p, None, None, dims=layout_of(name, p)))

    sizes = [s.numel for s in slots if not s.static]
    min_blocks = max(min_blocks, min(want_blocks, sum(sizes)))
    elems = _block_elems(max(1, block_bytes // 4), sizes, min_blocks)
    per_rank = min(min_blocks * ranks, sum(sizes))
    if sum(-(-n // elems) for n in sizes) < per_rank:
        # blocks of even size: a split by bytes then gives every share as many blocks
        elems = max(1, sum(sizes) // per_rank)
    blocks = []
    for si, s in enumerate(slots):
        n = s.numel
        for start in range(0, n, elems):
            blocks.append(Block(si, start, min(n, start + elems)))
    return Plan(slots, blocks, aliases, fingerprint(optimizer), elems)


def mark_parallel(plan: Plan, replicated, global_slices) -> bool:
    """Mark which slots the ranks hold alike (``Config.replicated``: None, True, False or
    parameter names; a DTensor as its placements say: replicated among the ranks of its
    mesh's ``Replicate()`` dimensions, unless ``replicated`` is False) and where a plain tensor
    lies in a global one (``Config.global_slices``). Returns whether any slot is replicated.
    ConfigError naming a parameter the plan does not have, a DTensor named in
    ``global_slices`` or ``replicated`` (its place is its own), a block that does not fit its
    global shape, or -- some state replicated -- a plain parameter neither replicated nor a
    slice (a checkpoint in shares holds one global state: what is not replicated must say
    where it lies)."""
    by_name = {s.name: s for s in plan.slots}

    def slot(name: str, option: str) -> Slot:
        found = by_name.get(plan.aliases.get(name, name))
        if found is None:
            known = ", ".join(list(by_name)[:4]) + (", ..." if len(by_name) > 4 else "")
            raise ConfigError(f"Config.{option} names {name!r}, which is not a parameter of "
                              f"the model ({known})")
        return found

    dtensors = {s.name for s in plan.slots if s.global_slice is not None}
    for name, (shape, offsets) in (global_slices or {}).items():
        s = slot(name, "global_slices")
        if s.name in dtensors:
            raise ConfigError(f"Config.global_slices names {name!r}, a DTensor: its place in "
                              "the global tensor is its own")
        lengths = tuple(s.local.shape)
        if len(shape) != len(lengths) or any(o + n > d for o, n, d in
                                             zip(offsets, lengths, shape)):
            raise ConfigError(f"Config.global_slices[{name!r}]: a block of {list(lengths)} at "
                              f"{list(offsets)} does not fit in the global shape {list(shape)}")
        s.global_slice = (tuple(shape), tuple(offsets))
    if replicated is True and global_slices:
        raise ConfigError("Config(replicated=True) with global_slices: a slice of a "
                          "partitioned tensor is no replica; name the replicated "
                          "parameters instead")
    named = set()
    if not (replicated is None or isinstance(replicated, bool)):
        named = {slot(n, "replicated").name for n in replicated}
        for s in plan.slots:
            if s.name in named and s.global_slice is not None:
                raise ConfigError(f"parameter {s.name!r} is named in Config.replicated but is "
                                  "a slice of a global tensor (a DTensor or in global_slices)")
    for s in plan.slots:
        if s.name in dtensors:  # replicated where its placements say (unless told not to)
            holders = replicas_of(s.param) if replicated is not False else None
            s.replicated = holders is not None and len(holders) > 1
            s.replicas = holders if s.replicated else None
        else:
            s.replicated, s.replicas = s.name in named or replicated is True, None
    if any(s.replicated for s in plan.slots):
        for s in plan.slots:
            if not s.replicated and s.global_slice is None:
                raise ConfigError(
                    f"parameter {s.name!r} is neither replicated nor a slice of a global "
                    "tensor (a DTensor, or named in Config.global_slices): with some state "
                    "replicated across the ranks, name the replicated plain parameters in "
                    "Config.replicated and say where the others lie in Config.global_slices")
        return True
    return False


def _block_elems(elems: int, sizes: List[int], min_blocks: int) -> int:
    """The largest block size up to ``elems`` that cuts tensors of ``sizes`` elements into at
    least ``min_blocks`` blocks; ConfigError when even one element per block is too few."""
    def count(e: int) -> int:
        return sum(-(-n // e) for n in sizes)

    if count(elems) >= min_blocks:
        return elems
    if sum(sizes) < min_blocks:
        raise ConfigError(
            f"overlap_steps={min_blocks} needs at least {min_blocks} blocks to copy, one group "
            f"per step, but the optimizer's parameters hold {sum(sizes)} elements in all; "
            f"ask for overlap_steps <= {max(1, sum(sizes))}")
    lo, hi = 1, elems  # count(lo) >= min_blocks > count(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) >= min_blocks else (lo, mid)
    return lo


def fingerprint(optimizer: torch.optim.Optimizer) -> tuple:
    """Which parameters the optimizer updates, group by group: a change (add_param_group, a
    group's parameter list edited) makes the plan stale."""
    return tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)


def same_params(optimizer: torch.optim.Optimizer, planned: tuple) -> bool:
    """Whether ``optimizer`` updates the parameters of the :func:`fingerprint` ``planned``,
    group by group: one C++ pass over the lists (no ``id()`` object per parameter: this runs
    in every step of a checkpoint's window)."""
    groups = optimizer.param_groups
    if type(groups) is list and _tensors.same_params(groups, planned):
        return True
    return fingerprint(optimizer) == planned  # (any other shape of param_groups)


def stepped_groups(planned: tuple, optimizer: torch.optim.Optimizer) -> Optional[Tuple[int, ...]]:
    """The planned index of each param group ``optimizer`` is about to step: every group, or a
    subset when the caller narrows ``param_groups`` for the call (DeepSpeed's ZeRO 1/2 step
    the base optimizer group by group); None when the groups are not the planned ones (the
    plan is stale).  ``planned`` is the :func:`fingerprint` taken at planning."""
    if same_params(optimizer, planned):
        return tuple(range(len(planned)))
    now = fingerprint(optimizer)
    out: List[int] = []
    for params in now:
        index = next((i for i, q in enumerate(planned) if q == params and i not in out), None)
        if index is None:
            return None
        out.append(index)
    return tuple(out)


def check_layouts(plan: Plan) -> None:
    """Raise LayoutChangedError if a parameter's strides differ from those planned."""
    if _tensors.strides_match(plan.locals(), plan.strides):
        return  # (one C++ pass: this runs at every checkpoint)
    for s in plan.slots:
        if s.local.stride() != s.strides:
            raise LayoutChangedError(
                f"parameter {s.name!r} changed its memory layout after the Checkpointer was "
                f"built (strides {s.strides} -> {tuple(s.local.stride())}); change layouts (e.g. "
                "model.to(memory_format=...)) before creating the optimizer and the "
                "Checkpointer, or close this Checkpointer and create a new one")
