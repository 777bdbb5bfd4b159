"""The self-check: replayed blocks must equal a direct copy of the live state at F.

A few blocks captured before F (so reached F by replay) are copied directly at the boundary of
F; once the replay is done the two must agree bit for bit. A mismatch means the replay is not
exact for this optimizer or run, which would otherwise go unnoticed until a restore.
"""

from __future__ import annotations

import random
import warnings

import torch

from ..capture.plan import Plan, flat
from ..errors import ConsistencyError
from ..job import Job


def sample(job: Job, plan: Plan, optimizer: torch.optim.Optimizer, fraction: float) -> None:
    """At the boundary of F: copy a ``fraction`` of the replayed blocks directly."""
    replayed = list(job.capture.captured)  # captured before F: their copies get replayed
    if not replayed or fraction <= 0:
        return
    n = max(1, round(fraction * len(replayed)))
    # Seeded by the boundary so that a run picks the same blocks every time.
    picks = replayed if n >= len(replayed) else random.Random(job.f_boundary).sample(
        replayed, n)
    for b in picks:
        slot = plan.slots[b.slot]
        live = optimizer.state.get(slot.param, {})
        direct = {"param": flat(slot.param, slot.dims)[b.start:b.end].to("cpu", copy=True)}
        for key in job.host.keys[b.slot]:
            if key in live:
                direct[key] = flat(live[key], slot.dims)[b.start:b.end].to("cpu", copy=True)
        job.capture.samples.append((b, direct))


def verify(job: Job, plan: Plan, strict: bool) -> None:
    """After the replay: compare the samples; raise (``strict``) or warn on a mismatch."""
    host = job.host
    bad = []
    for b, direct in job.capture.samples:
        s, e = b.start, b.end
        if not torch.equal(direct["param"], host.param[b.slot][s:e]):
            bad.append(f"{plan.slots[b.slot].name}[{s}:{e}] (param)")
        for key, ref in direct.items():
            if key != "param" and not torch.equal(ref, host.state[b.slot][key][s:e]):
                bad.append(f"{plan.slots[b.slot].name}[{s}:{e}] ({key})")
    job.metrics.self_check_blocks = len(job.capture.samples)
    job.metrics.self_check_mismatches = len(bad)
    job.capture.samples = []
    if bad:
        msg = (f"self-check: {len(bad)} replayed block(s) differ from a direct copy at step "
               f"{job.handle.final_step}: {', '.join(bad[:5])}")
        if strict:
            raise ConsistencyError(msg + "; the checkpoint is not committed")
        warnings.warn("gockpt: " + msg)
