"""A small training setup that exercises everything the checkpoint must get right:
clipping, two param groups with different lr / weight decay, a parameter that gets no
gradient in some steps, a frozen parameter, BatchNorm buffers, dropout, an LR schedule,
and optionally fp16 autocast with a GradScaler (with a step skipped on inf)."""

from __future__ import annotations

import copy
import random

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 48)
        self.bn = nn.BatchNorm1d(48)
        self.drop = nn.Dropout(0.2)
        self.hidden = nn.Linear(48, 48)
        self.aux = nn.Linear(48, 48)          # used only on odd steps: no gradient otherwise
        self.frozen = nn.Linear(48, 48)       # requires_grad=False
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(48, 4)

    def forward(self, x, step):
        h = torch.relu(self.bn(self.inp(x)))
        h = self.drop(h)
        h = torch.relu(self.hidden(h)) + 0.1 * self.frozen(h)
        if step % 2 == 1:
            h = h + torch.tanh(self.aux(h))
        return self.out(h)


def build(seed=0, *, optim="adamw", impl="single", schedule=True):
    """Model, optimizer (two groups), scheduler, all deterministic from ``seed``."""
    torch.manual_seed(seed)
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1 and p.requires_grad]
    kw = {}
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "fused":
        kw["fused"] = True
    cls = torch.optim.AdamW if optim == "adamw" else torch.optim.Adam
    groups = [{"params": decay, "lr": 3e-3, "weight_decay": 0.05},
              {"params": no_decay, "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)}]
    if optim == "adamw":
        groups.append({"params": [model.frozen.weight], "lr": 1e-3})  # frozen but optimized
    opt = cls(groups, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.07 * s)) \
        if schedule else None
    return model, opt, sched


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    y = torch.randint(0, 4, (32,), generator=g)
    return x, y


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def train_steps(model, opt, sched, start, stop, ck=None, *, scaler=None, inf_steps=(),
                on_boundary=None, force=(), extra=None):
    """Run steps [start, stop); returns the losses. ``force``: steps (as passed to
    save_checkpoint) at which to force a checkpoint; ``on_boundary(step, handle)`` runs after
    each save_checkpoint."""
    losses = []
    model.train()
    for step in range(start, stop):
        x, y = batch(step)
        # consume a little of every RNG so that restoring them matters
        noise = float(np.random.rand()) + random.random()
        if scaler is not None:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x, step)
            loss = nn.functional.cross_entropy(logits.float(), y) * (1 + 0.01 * noise)
        else:
            loss = nn.functional.cross_entropy(model(x, step), y) * (1 + 0.01 * noise)
        losses.append(loss.item())
        if ck is not None:
            ck.backward_begin()
        if scaler is not None:
            scaler.scale(loss).backward()
            if step in inf_steps:
                model.out.weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if ck is not None:
            ck.update_begin()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        handle = None
        if ck is not None:
            ex = extra(step + 1) if extra else {"epoch": step // 5, "note": "x"}
            handle = ck.save_checkpoint(step + 1, extra_state=ex, force=(step + 1) in force)
        if on_boundary is not None:
            on_boundary(step + 1, handle)
    return losses


def snapshot(model, opt, sched):
    """Deep copies of every piece of live state."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(opt.state_dict()),
        "sched": copy.deepcopy(sched.state_dict()) if sched is not None else None,
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.get_state(),
        "py_rng": random.getstate(),
    }


def assert_same(a, b, path="state"):
    """Bitwise equality of nested state (tensors compared with torch.equal, dtype too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} " \
            f"vs {b.dtype}{tuple(b.shape)}"
        if a.is_floating_point():
            same = torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                               b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))
        else:
            same = torch.equal(a, b)
        assert same, f"{path}: tensors differ in {(a != b).sum().item()} elements"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: dict vs {type(b)}"
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"
