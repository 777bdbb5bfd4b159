"""The checks that every replayed byte is the live state at F, before anything is committed.

* **Digests** (always, unless ``Config.verify=False``): at the boundary of F the device digests
  the live tensors of every replayed block (:meth:`Capture.digest_replayed`); after the replay
  the host digests its copy (:func:`gockpt.replay.digest.digest_segments`), and they must agree.
  A mismatch names the tensors written outside the replayed optimizer (a second optimizer, an
  in-place clamp, ...): that checkpoint is not committed, and those tensors are copied directly
  at F from then on.
* **Sampled direct copies** (``Config.self_check``, a fraction): a few replayed blocks copied
  at F and compared bit for bit -- a debugging aid for the replay itself; a mismatch fails the
  checkpoint with an error.
"""

from __future__ import annotations

import random
import time
import warnings

import numpy as np

import torch

from ..capture.plan import Plan, flat
from ..errors import ConsistencyError
from ..job import Job
from .digest import digest_segments


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
    """After the replay: the sampled direct copies, then the digests; raises
    ConsistencyError on a mismatch (sampled copies: warns instead unless ``strict``)."""
    _compare_samples(job, plan, strict)
    _compare_digests(job, plan)


def _compare_digests(job: Job, plan: Plan) -> None:
    """The host copy's digests of the replayed blocks against the live ones taken at F."""
    if job.capture.digests is None:
        return
    table, rows, ticket, _ = job.capture.digests
    t0 = time.perf_counter()
    live = ticket.wait()
    every = np.concatenate([r for _, r in rows])
    host = digest_segments(
        np.concatenate([job.host.bases(k)[0][table.slot[r]] + table.start[r] * 4
                        for k, r in rows]), table.numel[every], table.start[every])
    bad = np.flatnonzero((live != host).any(axis=1))
    m = job.metrics
    m.verify_blocks, m.verify_mismatches = len(table), len(bad)
    m.verify_s = ticket.seconds + time.perf_counter() - t0
    if len(bad):
        names = sorted({plan.slots[s].name for s in table.slot[every[bad]].tolist()})
        job.capture.written_outside.update(names)
        raise ConsistencyError(
            f"{', '.join(names[:5])}{' and others' if len(names) > 5 else ''} differ from their "
            f"replay at step {job.handle.final_step} ({len(bad)} of {len(every)} "
            "replayed blocks): something other than the attached optimizer wrote them (a "
            "second optimizer, an in-place clamp or renorm, add_param_group, ...)")


def _compare_samples(job: Job, plan: Plan, strict: bool) -> None:
    """The sampled direct copies taken at F against the replayed blocks."""
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
