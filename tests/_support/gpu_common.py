"""A small GPT-like model on a CUDA device for the GPU tests (and their resume worker)."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        return self.head(self.norm(self.body(self.emb(ids))))


def build(impl: str, seed: int = 0):
    """Model and AdamW (``impl``: "fused" or "foreach") on the GPU, with a scheduler."""
    torch.manual_seed(seed)
    model = Tiny().cuda()
    kw = {"fused": True} if impl == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    return model, opt, sched


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (8, 12), generator=g).cuda()


def train(model, opt, sched, start, stop, ck=None, force=(), on_boundary=None):
    """Steps [start, stop) with the hooks when ``ck`` is given; returns the losses."""
    losses = []
    for step in range(start, stop):
        ids = batch(step)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        losses.append(loss.item())
        if ck is not None:
            ck.backward_begin()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if ck is not None:
            ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        h = ck.save_checkpoint(step + 1, force=step + 1 in force) if ck is not None else None
        if on_boundary is not None:
            on_boundary(step + 1, h)
    return losses
