"""A small training setup that exercises everything the checkpoint must get right:
clipping, two param groups with different lr / weight decay, a parameter that gets no
gradient in some steps, a frozen parameter, BatchNorm buffers, dropout, an LR schedule,
and optionally fp16 autocast with a GradScaler (with a step skipped on inf)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch
from torch import nn

from gockpt import testing


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


def step_group_by_group(opt):
    """``opt.step()`` the way DeepSpeed's ZeRO 1/2 call their base optimizer: once per param
    group, with ``param_groups`` narrowed to that group for the call."""
    groups = opt.param_groups
    try:
        for g in groups:
            opt.param_groups = [g]
            opt.step()
    finally:
        opt.param_groups = groups


def train_steps(model, opt, sched, start, stop, ck=None, *, scaler=None, inf_steps=(),
                on_boundary=None, force=(), at=(), extra=None, names=None, group_by_group=False,
                clip=None):
    """Run steps [start, stop); returns the losses. ``force``: steps (as passed to
    save_checkpoint) at which to force a checkpoint; ``at``: steps announced with
    ck.plan_checkpoint (the replay modes copy over the K steps up to them);
    ``on_boundary(step, handle)`` runs after
    each save_checkpoint. ``names``: {step: name} of checkpoints to force with that name.
    ``group_by_group``: step the optimizer as :func:`step_group_by_group` does.  ``clip(model)``
    replaces the default gradient clipping."""
    losses = []
    model.train()
    for step in at:
        ck.plan_checkpoint(step)
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
        if clip is not None:
            clip(model)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if ck is not None:
            ck.update_begin()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif group_by_group:
            step_group_by_group(opt)
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        handle = None
        if ck is not None:
            ex = extra(step + 1) if extra else {"epoch": step // 5, "note": "x"}
            name = (names or {}).get(step + 1)
            handle = ck.save_checkpoint(step + 1, extra_state=ex, name=name,
                                        force=(step + 1) in force or name is not None)
        if on_boundary is not None:
            on_boundary(step + 1, handle)
    return losses


# The state snapshot and the bitwise comparison live in the library (gockpt.testing); these
# names are what the tests call.
snapshot = testing.snapshot
assert_same = testing.assert_same


def state_digest(model, opt) -> str:
    """sha256 of every model and optimizer state tensor's bytes, by name (a resumed run in
    another process compares it with an uninterrupted one's); any device."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for idx, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{idx}/{k}".encode())
            h.update(v.cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
