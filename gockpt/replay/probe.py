"""The attach-time probe: run the real optimizer for a few steps on a small problem -- on the
device the training runs on -- and replay them on the CPU; any difference refuses the replay
modes at construction instead of at F. This is what makes the bitwise claim hold on a torch
build, CPU or GPU that was never measured."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import arithmetic
from ..core.memory import local
from ..core.records import GroupScalars, Kernel
from .claims import moments_weight_decay

_PROBED: Dict[tuple, bool] = {}
_N = 1032  # a multiple of 4 and 8 plus a tail for every wider vector: exercises the tails


def probe(cls, sc: GroupScalars, device: Optional[torch.device] = None,
          moments_only: bool = False, like: Optional[torch.Tensor] = None) -> bool:
    """Replay three steps of ``cls`` with the settings ``sc`` on ``device`` (default: CPU) and
    compare with what the real optimizer computed there, bit for bit (a NaN equals a NaN).
    ``moments_only``: compare the moments alone, on an odd element count, each step starting
    from the real parameter (what a replay claiming only the moments reproduces: their
    parameters are copied at F). ``like``: a DTensor parameter -- the real optimizer then
    steps DTensors on its mesh with its placements (each rank its local shard, no collective),
    as it steps the training's."""
    device = torch.device("cpu") if device is None else torch.device(device)
    placements = None if like is None else _flat_placements(like)
    key = (cls, sc, torch.get_num_threads(), str(device), moments_only,
           None if like is None else (like.device_mesh.ndim, tuple(map(str, placements))))
    if key not in _PROBED:
        _PROBED[key] = _run_probe(cls, sc, device, moments_only, like, placements)
    return _PROBED[key]


def _flat_placements(like: torch.Tensor) -> tuple:
    """``like``'s placements for the probe's 1-D tensors: a sharded dimension becomes dimension
    0 (the update is elementwise: which dimension is split does not change a shard's
    arithmetic; a row-parallel Shard(1) cannot place a 1-D tensor)."""
    from torch.distributed.tensor import Shard  # (like is a DTensor: imported already)
    return tuple(Shard(0) if p.is_shard() else p for p in like.placements)


def _run_probe(cls, sc: GroupScalars, device: torch.device, moments_only: bool = False,
               like: Optional[torch.Tensor] = None, placements: tuple = ()) -> bool:
    gen = torch.Generator().manual_seed(7)
    # CPU: an odd size; CUDA fused wants n % 4 == 0 for every tensor, and an odd one for the
    # moments alone
    n = _N - 1 if device.type == "cpu" or moments_only else _N

    def placed(t: torch.Tensor) -> torch.Tensor:  # as the training's parameters are
        return t if like is None else type(like).from_local(t, like.device_mesh, placements,
                                                         run_check=False)

    p = torch.nn.Parameter(placed((torch.rand(n, generator=gen) - 0.5).to(device)))
    if sc.impl is Kernel.DEEPSPEED_CUDA_MOMENTS:  # DeepSpeed's FusedAdam
        kw = {"adam_w_mode": sc.decoupled}
    else:  # torch's Adam/AdamW
        impl = sc.impl.replace("cuda-", "")
        kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = cls([p], lr=sc.lr, betas=(sc.beta1, sc.beta2), eps=sc.eps,
              weight_decay=sc.weight_decay, **kw)
    mine = [local(p).detach().cpu().clone(), torch.zeros(n), torch.zeros(n)]
    for t in range(1, 4):
        grad = torch.rand(n, generator=gen) - 0.5
        p.grad = placed(grad.to(device))
        if moments_only:  # the parameter this step reads is the real one (copied at F)
            mine[0] = local(p).detach().cpu().clone()
        arithmetic.adam_replay(*mine, grad, impl=sc.impl, decoupled=sc.decoupled, lr=sc.lr,
                               beta1=sc.beta1, beta2=sc.beta2, eps=sc.eps,
                               weight_decay=moments_weight_decay(sc.decoupled, sc.weight_decay)
                               if moments_only else sc.weight_decay, step=float(t), threads=1)
        opt.step()
    st = opt.state[p]
    real = (p, st["exp_avg"], st["exp_avg_sq"])
    pairs = list(zip(mine, real))[1:] if moments_only else zip(mine, real)
    return all(_same_bits(a, local(b).detach().cpu()) for a, b in pairs)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, a NaN counted equal to a NaN in the same place (payloads may differ
    between devices)."""
    nan = torch.isnan(a) & torch.isnan(b)
    return torch.equal(torch.where(nan, 0.0, a).view(torch.int32),
                       torch.where(nan, 0.0, b).view(torch.int32))
