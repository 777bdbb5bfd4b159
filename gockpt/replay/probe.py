"""The attach-time probe: run the real optimizer for a few steps on a small problem and replay
them; any difference refuses the replay modes at construction instead of at F."""

from __future__ import annotations

from typing import Dict

import torch

from . import arithmetic
from .records import GroupScalars


_PROBED: Dict[tuple, bool] = {}


def probe(cls, sc: GroupScalars) -> bool:
    """Replay three steps of a small random problem and compare with torch itself: refuses
    a torch version or CPU whose arithmetic differs, at attach time instead of at F."""
    key = (cls, sc, torch.get_num_threads())
    if key in _PROBED:
        return _PROBED[key]
    gen = torch.Generator().manual_seed(7)
    n = 1031  # not a multiple of any vector width: exercises tails
    p = torch.nn.Parameter(torch.rand(n, generator=gen) - 0.5)
    kw = {"fused": True} if sc.impl == "fused" else {"foreach": sc.impl == "foreach"}
    opt = cls([p], lr=sc.lr, betas=(sc.beta1, sc.beta2), eps=sc.eps,
              weight_decay=sc.weight_decay, **kw)
    mine = [p.detach().clone(), torch.zeros(n), torch.zeros(n)]
    for t in range(1, 4):
        p.grad = torch.rand(n, generator=gen) - 0.5
        arithmetic.adam_replay(*mine, p.grad, impl=sc.impl, decoupled=sc.decoupled, lr=sc.lr,
                             beta1=sc.beta1, beta2=sc.beta2, eps=sc.eps,
                             weight_decay=sc.weight_decay, step=float(t), threads=1)
        opt.step()
    st = opt.state[p]
    ok = all(torch.equal(a, b) for a, b in
             zip(mine, (p.detach(), st["exp_avg"], st["exp_avg_sq"])))
    _PROBED[key] = ok
    return ok
