"""The checks that every stored byte is the live state at F, before anything is committed.

* **Digests** (always, unless ``Config.verify=False``), in every mode: at the boundary of F the
  live tensors -- every parameter and aligned optimizer state tensor, read through torch as
  the framework presents them -- are digested on their device (:meth:`Capture.digest_live`);
  once every block is at F the staged host copy is digested by the same function
  (:mod:`gockpt.core.digest`), and they must agree. The digests share nothing with the
  copy path (addresses, queues, kernels), so a copy of the wrong memory is caught as surely
  as a replay that went wrong. A mismatch names the tensors: written in place since F (a torn
  reading) or outside the replayed optimizer (a second optimizer, an in-place clamp, ...),
  they are copied directly at F from then on; a copied tensor that differs fails the
  checkpoint. The verified digests go into the manifest, so that ``load`` and ``verify``
  check the data end to end against what training had.
* **Sampled direct copies** (``Config.self_check``, a fraction): a few replayed blocks copied
  at F and compared bit for bit -- a debugging aid for the replay itself; a mismatch fails the
  checkpoint with an error.
"""

from __future__ import annotations

import random
import time
import warnings
from typing import Dict

import torch

from ..core.digest import as_pairs, digests, to_hex
from ..core.memory import flat, local
from ..core.plan import Plan
from ..core.errors import Adaptation, ConsistencyError
from ..core.job import Job


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
        direct = {"param": flat(slot.local, slot.dims)[b.start:b.end].to("cpu", copy=True)}
        for key in job.host.keys[b.slot]:
            if key in live:
                direct[key] = flat(local(live[key]), slot.dims)[b.start:b.end].to("cpu",
                                                                                  copy=True)
        job.samples.append((b, direct))


def verify(job: Job, plan: Plan, strict: bool, replayed: bool = True, threads: int = 0) -> Dict:
    """After the replay (``replayed``: this mode replays): the sampled direct copies, then the
    digests (of the staged copy: on ``threads`` of gockpt's pool, 0: every core, as the
    replay); returns the verified digests, (slot, None or state key) -> hex; raises
    ConsistencyError on a mismatch (sampled copies: warns instead unless ``strict``)."""
    _compare_samples(job, plan, strict)
    return _compare_digests(job, plan, replayed, threads)


def _compare_digests(job: Job, plan: Plan, replayed: bool, threads: int) -> Dict:
    """The staged host copy's digests against the live ones taken at F."""
    book = job.capture.live_digests
    if book is None:
        return {}
    live = book.pairs()
    t0 = time.perf_counter()
    host = job.host
    staged = as_pairs(digests([plan.slots[si].staged_view(host.param[si] if key is None
                                                          else host.state[si][key])
                               for si, key in book.entries], threads))
    bad = [e for e, x, y in zip(book.entries, live, staged) if x != y]
    m = job.metrics
    m.verify_tensors, m.verify_mismatches = len(book.entries), len(bad)
    m.verify_live_s = book.seconds()
    m.verify_s = m.verify_live_s + time.perf_counter() - t0
    if bad:
        _refuse(job, plan, bad, len(book.entries), book.written(), replayed)
    return {e: to_hex(pair) for e, pair in zip(book.entries, live)}


def _refuse(job: Job, plan: Plan, bad, total: int, written: set, replayed: bool) -> None:
    """ConsistencyError naming the ``bad`` entries, by what explains them; those that a copy at
    F fixes are marked to be copied at F from now on."""
    step = job.handle.final_step

    def names(entries):
        out = sorted({plan.slots[si].name for si, _ in entries})
        return f"{', '.join(out[:5])}{' and others' if len(out) > 5 else ''}"

    torn = [e for e in bad if e[0] in written]
    moved = [e for e in bad if e[0] not in written and replayed and not plan.slots[e[0]].at_f]
    copied = [e for e in bad if e not in torn and e not in moved]
    reasons = []
    if torn:
        reasons.append(f"{names(torn)} {'was' if len(torn) == 1 else 'were'} written in place "
                       f"after step {step} while gockpt read {'it' if len(torn) == 1 else 'them'}"
                       " (an in-place write outside the optimizer, e.g. "
                       "nn.Embedding(max_norm=...))")
    if moved:
        reasons.append(f"{names(moved)} differ from their replay at step {step} ({len(moved)} "
                       f"of {total} tensors): something other than the attached optimizer "
                       "wrote them (a second optimizer, an in-place clamp or renorm, "
                       "add_param_group, ...)")
    if copied:
        reasons.append(f"the staged copy of {names(copied)} differs from the live tensor at "
                       f"step {step} as torch presents it: gockpt copied other memory than the "
                       "tensor holds (a tensor subclass or storage it cannot address, or a bug "
                       "in gockpt: please report it)")
    outside = sorted({plan.slots[si].name for si, _ in torn + moved})
    raise ConsistencyError("; ".join(reasons), adapt=Adaptation.COPY_AT_F if outside else None,
                           tensors=outside)


def _compare_samples(job: Job, plan: Plan, strict: bool) -> None:
    """The sampled direct copies taken at F against the replayed blocks."""
    host = job.host
    bad = []
    for b, direct in job.samples:
        at, s, e = plan.slots[b.slot].host_slice(b.start, b.end), b.start, b.end
        if not torch.equal(direct["param"], host.param[b.slot][at]):
            bad.append(f"{plan.slots[b.slot].name}[{s}:{e}] (param)")
        for key, ref in direct.items():
            if key != "param" and not torch.equal(ref, host.state[b.slot][key][at]):
                bad.append(f"{plan.slots[b.slot].name}[{s}:{e}] ({key})")
    job.metrics.self_check_blocks = len(job.samples)
    job.metrics.self_check_mismatches = len(bad)
    job.samples = []
    if bad:
        msg = (f"self-check: {len(bad)} replayed block(s) differ from a direct copy at step "
               f"{job.handle.final_step}: {', '.join(bad[:5])}")
        if strict:
            raise ConsistencyError(msg + "; the checkpoint is not committed")
        warnings.warn("gockpt: " + msg)
