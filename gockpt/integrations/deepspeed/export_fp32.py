"""``gockpt export PATH --to fp32 OUT``: the consolidated fp32 master weights of a checkpoint
written through the DeepSpeed integration, named like the model's parameters -- what
DeepSpeed's ``zero_to_fp32.py`` gives for its own checkpoints.  Every rank's part holds its
ZeRO fragments and their places (``fp32_layout`` in the small state); they are put together
here, and every element of every parameter must be covered exactly once."""

from __future__ import annotations

import math

import torch

from ... import storage
from ...storage.manifest import parse as parse_manifest
from ...storage.schema import Manifest, is_small_tensor
from ...core.errors import CorruptCheckpointError


def consolidated_fp32(sources) -> dict:
    """``sources``: (path, manifest data) of every rank's part, in rank order.  Returns
    ``{parameter name: fp32 tensor}`` in the model's order."""
    out, covered, shapes = {}, {}, {}
    for path, data in sources:
        m = parse_manifest(path, data)
        small = storage.read_tensors(path, m, [n for n in m.tensors if is_small_tensor(n)],
                                     verify=True)
        try:
            layout = m.small.decode("extra_state", small)["fp32_layout"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{path}: no fp32 layout; --to fp32 exports checkpoints written "
                                "through gockpt.integrations.deepspeed (use --to safetensors "
                                "for others)") from None
        masters = {}
        for name, (group, hp_start, lp_start, numel, shape) in layout.items():
            key = f"master_g{group}_p0"
            if key not in masters:
                masters[key] = _master(path, m, key)
            full = out.setdefault(name, torch.zeros(math.prod(shape), dtype=torch.float32))
            full[lp_start:lp_start + numel] = masters[key][hp_start:hp_start + numel]
            covered[name] = covered.get(name, 0) + numel
            shapes[name] = shape
    result = {}
    for name, shape in shapes.items():
        if covered[name] != math.prod(shape):
            raise CorruptCheckpointError(f"parameter {name!r}: the parts cover {covered[name]} of its "
                                f"{math.prod(shape)} elements; pass the checkpoint of every rank")
        result[name] = out[name].view(shape)
    return result


def _master(path: str, m: Manifest, key: str) -> torch.Tensor:
    ref = m.model.params.get(key)
    if ref is None:
        raise CorruptCheckpointError(f"{path}: no tensor {key!r}")
    tensors = storage.read_tensors(path, m, [ref.tensor], verify=True)
    return ref.resolve(tensors).reshape(-1)
