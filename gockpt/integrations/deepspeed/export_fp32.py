"""``gockpt export PATH --to fp32 OUT``: the consolidated fp32 master weights of a checkpoint
written through the DeepSpeed integration, named like the model's parameters -- what
DeepSpeed's ``zero_to_fp32.py`` gives for its own checkpoints.  Every rank's part holds its
ZeRO fragments and their places (``fp32_layout`` in the small state); they are put together
here, and every element of every parameter must be covered exactly once."""

from __future__ import annotations

import math
from typing import List

import torch

from ...core.errors import CorruptCheckpointError
from .export_files import Part


def consolidated_fp32(parts: List[Part]) -> dict:
    """``parts``: every rank's part, read (:func:`.export_files.read_parts`), in rank order.
    Returns ``{parameter name: fp32 tensor}`` in the model's order."""
    out, covered, shapes = {}, {}, {}
    if parts[0].m.replicated:  # ZeRO 0 on several ranks: each part sees the same whole state
        parts = parts[:1]
    for part in parts:
        layout = part.record["fp32_layout"]
        for name, entry in layout.items():
            try:
                group, hp_start, lp_start, numel, shape = entry
                master = part.masters[group, 0].reshape(-1)
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpointError(f"{part.path}: fp32_layout entry {name!r} is "
                                             "malformed or its master tensor is missing"
                                             ) from None
            full = out.setdefault(name, torch.zeros(math.prod(shape), dtype=torch.float32))
            full[lp_start:lp_start + numel] = master[hp_start:hp_start + numel]
            covered[name] = covered.get(name, 0) + numel
            shapes[name] = shape
    result = {}
    for name, shape in shapes.items():
        if covered[name] != math.prod(shape):
            raise CorruptCheckpointError(f"parameter {name!r}: the parts cover {covered[name]} "
                                         f"of its {math.prod(shape)} elements; pass the "
                                         "checkpoint of every rank")
        result[name] = out[name].view(shape)
    return result
