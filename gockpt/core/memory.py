"""How a parameter lies in memory: its memory order (the permutation that makes it
contiguous), flat views in that order, and whether gockpt can address it at all (a meta or
quantized tensor cannot be; a DTensor -- FSDP2, tensor parallelism -- through its local shard,
which is what every stage copies, replays and stores: ``local``, and back: ``like``)."""

from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .errors import ConfigError, UnsupportedTensorError


def memory_order(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The permutation ``dims`` for which ``t.permute(dims)`` is contiguous: ``()`` when ``t``
    is contiguous already, ``None`` when ``t`` is not dense (overlapping, or with holes)."""
    if t.is_contiguous():
        return ()
    dims = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d))))
    return dims if t.permute(dims).is_contiguous() else None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor. Looked up in ``sys.modules``, not imported: until something
    imports ``torch.distributed.tensor`` no DTensor exists, and importing it costs half a
    second of every process's start (a process that trains without one never pays it)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def local(t):
    """The tensor whose memory holds ``t``'s elements on this rank: a DTensor's local shard
    (looked up at each call: FSDP2 may give a parameter a new one, e.g. at its lazy init),
    any other tensor (or None) itself. A DTensor reports ``data_ptr() == 0``: copied by address
    it would be checkpointed as zeros at its global shape."""
    return t._local_tensor if is_dtensor(t) else t


def like(template: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local shard) as the live ``template`` presents it: a DTensor on its mesh
    with its placements when ``template`` is one (no collective), else ``value`` itself."""
    if not is_dtensor(template):
        return value
    return type(template).from_local(value, template.device_mesh, template.placements,
                              run_check=False, shape=template.shape, stride=template.stride())


def global_slice(t: torch.Tensor) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """(global shape, offsets of this rank's local shard in it, per dimension) of a DTensor,
    as torch.distributed.checkpoint's chunk metadata gives them; None for a plain tensor."""
    if not is_dtensor(t):
        return None
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(t._local_tensor.shape):
        raise UnsupportedTensorError(
            f"a DTensor of shape {tuple(t.shape)} with placements {t.placements} is not one "
            "contiguous block of the global tensor on this rank; gockpt stores local shards "
            "that are (FSDP2's Shard(0), tensor parallelism's Shard(d) or Replicate)")
    return tuple(t.shape), tuple(int(o) for o in chunks[0].offsets)


def replicas_of(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The global ranks whose local shard of DTensor ``t`` is this rank's (sorted, this rank
    among them): the ranks of its mesh that differ from this one only along the dimensions
    where ``t`` is ``Replicate()`` -- HSDP's replicate dimension, tensor parallelism's
    replicated parameters. ``(rank,)`` when it is replicated nowhere; None for a plain tensor
    (or a rank outside the mesh)."""
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    where = tuple(slice(None) if p.is_replicate() else c
                  for p, c in zip(t.placements, coordinate))
    return tuple(sorted(int(r) for r in mesh.mesh[where].reshape(-1).tolist()))


def check_addressable(name: str, p: torch.Tensor) -> None:
    """UnsupportedTensorError unless parameter ``name`` owns plain memory that gockpt can copy
    by address (a DTensor: its local shard does)."""
    if is_dtensor(p):
        check_addressable(name, p._local_tensor)
        global_slice(p)
        return
    if is_traceable_wrapper_subclass(p):
        raise UnsupportedTensorError(
            f"parameter {name!r} is a tensor subclass ({type(p).__name__}) whose memory "
            "gockpt cannot address; checkpoint this model with torch.distributed.checkpoint")
    if p.device.type == "meta" or isinstance(p, torch.nn.parameter.UninitializedParameter):
        raise UnsupportedTensorError(
            f"parameter {name!r} has no data yet ({'meta device' if p.device.type == 'meta' else 'a lazy module'}); "
            "create the Checkpointer once the model is materialised (after model.to_empty(...) "
            "and initialisation, or a first forward of lazy modules)")
    if p.is_quantized:
        raise UnsupportedTensorError(
            f"parameter {name!r} is a quantized tensor; gockpt stores floating-point "
            "parameters")


def layout_of(name: str, p: torch.Tensor) -> Tuple[int, ...]:
    """``memory_order`` of parameter ``name``; ConfigError if it has none (gockpt copies the
    storage of a dense tensor as one flat range, in memory order)."""
    check_addressable(name, p)
    p = local(p)
    dims = None if p.is_sparse else memory_order(p)
    if dims is None:
        raise ConfigError(
            f"parameter {name!r} is sparse or not dense (shape {tuple(p.shape)}, strides "
            f"{tuple(p.stride()) if not p.is_sparse else 'sparse'}); gockpt stores dense "
            "tensors in memory order. Make it contiguous (param.data = param.data.contiguous()) "
            "before creating the optimizer")
    return dims


def logical(shape: Tuple[int, ...], dims: Tuple[int, ...], staged: torch.Tensor) -> torch.Tensor:
    """A flat copy in memory order ``dims`` of a tensor of ``shape`` as the tensor it copies:
    its shape, its elements where the live tensor has them."""
    if not dims:
        return staged.view(shape)
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return staged.view(tuple(shape[d] for d in dims)).permute(inverse)


def flat(t: torch.Tensor, dims: Tuple[int, ...] = ()) -> torch.Tensor:
    """``t``'s elements in the memory order ``dims`` (see :func:`memory_order`) as a flat view;
    a flat copy when ``t`` itself is laid out otherwise (e.g. a gradient with other strides)."""
    v = t.detach().permute(dims) if dims else t.detach()
    return v.view(-1) if v.is_contiguous() else v.contiguous().view(-1)
