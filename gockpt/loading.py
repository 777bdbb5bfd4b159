"""Restore a committed checkpoint into a model, its optimizer and scheduler."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import storage
from .capture import smallstate
from .storage import tree
from .errors import CorruptCheckpointError, GockptError, LoadError


@dataclass
class Restored:
    """What :func:`load` restored."""

    step: int
    """The user's step number at version F (what was passed to ``save_checkpoint``)."""
    extra_state: Any
    """The ``extra_state`` given at F, decoded (tensors come back as CPU tensors)."""
    path: str
    """The checkpoint directory that was loaded."""
    manifest: dict
    """The validated manifest (mode, K, metrics, ...)."""


def load(directory: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         *, scheduler=None, tag: Optional[str] = None, restore_rng: bool = True,
         verify: bool = True, map_location=None, rank: Optional[int] = None) -> Restored:
    """Load the latest committed checkpoint in ``directory`` (or the one named ``tag``) into
    ``model``, ``optimizer`` and ``scheduler``, and restore RNG states unless
    ``restore_rng=False``. A checkpoint written by several ranks is loaded from this rank's
    part (``rank``, default: the torch.distributed rank). Parameters and optimizer state land on the device of the
    model's parameters; ``map_location`` (a device) moves the tensors of ``extra_state``.

    Names, shapes and dtypes are checked against the targets before any byte is read;
    checksums are verified unless ``verify=False``. Never unpickles.

    Raises:
        CheckpointNotFoundError: nothing committed at ``directory`` / ``tag``.
        CorruptCheckpointError: a checksum, file or manifest is wrong (names file and tensor).
        LoadError: the checkpoint does not fit ``model`` / ``optimizer``.
    """
    path = storage.resolve(directory, tag)
    manifest = storage.read_manifest(path)
    if manifest.get("ranks"):
        path, manifest = _rank_part(path, manifest, rank)
    try:
        params = manifest["model"]["params"]
        aliases = manifest["model"]["aliases"]
        small = manifest["small"]
        step = manifest["step"]
    except (KeyError, TypeError) as exc:
        raise LoadError(f"{path}: manifest lacks gockpt's model/small sections ({exc}); "
                        "is this a gockpt checkpoint?") from exc
    entries = manifest["tensors"]

    target = model.state_dict()
    expected = dict(params)
    expected.update({alias: params[name] for alias, name in aliases.items() if name in params})
    _check_params(path, target, expected, entries)

    # Small state first (cheap): the model's buffers must fit before any parameter is read.
    small_names = [n for n in entries if n.startswith("small/")]
    tensors = storage.read_tensors(path, manifest, small_names, verify=verify)
    try:
        model_small = tree.decode(small["model"], tensors)
        missing = sorted(set(target) - set(expected) - set(model_small))
        unexpected = sorted((set(expected) | set(model_small)) - set(target))
        if missing or unexpected:
            raise LoadError(f"{path}: model state does not match: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
        for name, value in model_small.items():
            _check_shape(path, name, target[name], value)
        if optimizer is not None:
            _check_optimizer(path, manifest, tensors, optimizer)
    except GockptError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise LoadError(f"{path}: cannot decode the model's small state: {exc}") from exc

    # Parameters are read straight into the model's (CPU) tensors: names, dtypes and shapes
    # were validated above, so only a checksum failure can interrupt a read.
    direct = {}
    for name, tname in params.items():
        t = target.get(name)
        if t is None:
            continue
        if t.device.type == "cpu" and t.is_contiguous():
            direct[tname] = t
        elif t.device.type == "cuda":  # pinned staging: the copy to the GPU is a fast DMA
            direct[tname] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    try:
        tensors.update(storage.read_tensors(
            path, manifest, [n for n in entries if n not in tensors], verify=verify, out=direct))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc}; the model's parameters may be partly overwritten: load an intact "
            "checkpoint (gockpt.load(..., tag=...)) before training on") from exc
    try:
        sd = {name: tensors[tname] for name, tname in expected.items()}
        sd.update(model_small)
        model.load_state_dict(sd)

        if optimizer is not None:
            optimizer.load_state_dict(_optimizer_state(path, manifest, tensors, optimizer))
        if scheduler is not None:
            sched = tree.decode(small["scheduler"], tensors)
            if sched is None:
                raise LoadError(f"{path} holds no scheduler state; pass scheduler=None")
            scheduler.load_state_dict(sched)
        if restore_rng:
            smallstate.restore_rng(tree.decode(small["rng"], tensors))
        extra = tree.decode(small["extra_state"], tensors)
        if map_location is not None:
            extra = _to_device(extra, torch.device(map_location))
    except GockptError:
        raise
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise LoadError(f"{path}: cannot restore this checkpoint into the given objects: "
                        f"{exc}") from exc
    return Restored(step=step, extra_state=extra, path=path, manifest=manifest)


def _rank_part(path, manifest, rank):
    """The part of ``rank`` in a checkpoint written by several ranks."""
    ranks = manifest["ranks"]
    dist = torch.distributed
    live_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if live_world > 1 else 0
    if live_world > 1 and live_world != len(ranks):
        raise LoadError(f"{path} was written by {len(ranks)} ranks; this job has {live_world}")
    if not isinstance(rank, int) or not 0 <= rank < len(ranks):
        raise LoadError(f"{path} has parts for ranks 0..{len(ranks) - 1}; rank {rank!r} asked")
    part = ranks[rank]
    if not isinstance(part, str) or "/" in part or part.startswith("."):
        raise LoadError(f"{path}: invalid part name {part!r} in the manifest")
    sub = os.path.join(path, part)
    return sub, storage.read_manifest(sub)


def _check_params(path, target, expected, entries) -> None:
    for name, tname in expected.items():
        if name not in target:
            raise LoadError(f"{path}: the checkpoint has parameter {name!r} that the model "
                            "does not have; load into a model of the same architecture")
        entry = entries.get(tname)
        if entry is None:
            raise LoadError(f"{path}: manifest names tensor {tname!r} for {name!r} but has no "
                            "such tensor")
        want = target[name]
        if list(want.shape) != list(entry["shape"]):
            raise LoadError(f"{path}: parameter {name!r} has shape {list(entry['shape'])} in "
                            f"the checkpoint but {list(want.shape)} in the model")
        if storage.DTYPE_TO_CODE.get(want.dtype) != entry["dtype"]:
            raise LoadError(f"{path}: parameter {name!r} is {entry['dtype']} in the checkpoint "
                            f"but {want.dtype} in the model")


def _check_shape(path, name, want, got) -> None:
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) \
            and want.shape != got.shape:
        raise LoadError(f"{path}: buffer {name!r} has shape {list(got.shape)} in the checkpoint "
                        f"but {list(want.shape)} in the model")


def _check_optimizer(path, manifest, tensors, optimizer) -> None:
    """The optimizer must have the saved class, groups and parameter count."""
    _optimizer_state(path, manifest, tensors, optimizer, aligned=False)


def _optimizer_state(path, manifest, tensors, optimizer, aligned: bool = True) -> dict:
    opt = manifest.get("optimizer") or {}
    if opt.get("class") not in (None, type(optimizer).__name__):
        raise LoadError(f"{path}: saved with optimizer {opt.get('class')}, loading into "
                        f"{type(optimizer).__name__}")
    small = tree.decode(manifest["small"]["optimizer"], tensors)
    n_live = sum(len(g["params"]) for g in optimizer.param_groups)
    n_saved = sum(len(g["params"]) for g in small["param_groups"])
    if n_live != n_saved or len(small["param_groups"]) != len(optimizer.param_groups):
        raise LoadError(f"{path}: the optimizer has {len(optimizer.param_groups)} groups / "
                        f"{n_live} parameters, the checkpoint {len(small['param_groups'])} / "
                        f"{n_saved}")
    state = small["state"]
    for idx, keys in (opt.get("aligned", {}) if aligned else {}).items():
        for key in keys:
            state.setdefault(int(idx), {})[key] = tensors[f"optim/{idx}/{key}"]
    return {"state": state, "param_groups": small["param_groups"]}


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj
