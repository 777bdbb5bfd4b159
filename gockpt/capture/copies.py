"""What the training-loop hooks hand to the transfer engine, and when it is valid.

Four kinds of capture feed one checkpoint:

    state groups   group j of blocks, queued at boundary N + j - 1: the version of the last update
    small state    everything small (buffers, scheduler, RNG, extra state), frozen at boundary F
    copies at F    slots the attached optimizer does not own, or found written outside it:
                   copied directly at the boundary of F, never replayed
    gradients      in the optimizer's step pre-hook: exactly what the update consumes, so that
                   the replay can bring every block captured before F up to version F
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..errors import ConfigError, HookOrderError
from ..job import Job
from ..replay.adapters import AdamAdapter
from ..replay.records import StepRecord
from ..storage import tree
from ..storage.manifest import SmallSection, small_prefix
from . import smallstate
from .plan import flat
from .staging import GradPool, HostCopy
from .transfer import GRADIENT, STATE, CopyEngine


class Capture:
    """Copies of one model/optimizer pair into a job's host copy."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, engine: CopyEngine, adapter: Optional[AdamAdapter]):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.engine, self.adapter = engine, adapter

    def declare_state_keys(self, host: HostCopy) -> None:
        """Which optimizer state tensors this checkpoint carries, per slot."""
        likes = {}
        for si, s in enumerate(host.slots):
            if s.static:
                continue
            if self.adapter is not None:
                likes[si] = {k: s.param for k in self.adapter.state_keys}
            else:
                live = self.optimizer.state.get(s.param, {})
                likes[si] = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)
                             and k != "step" and v.shape == s.param.shape}
        host.set_keys(likes)

    def state_bytes(self, host: HostCopy) -> int:
        """Bytes of parameters and aligned state one checkpoint copies."""
        total = 0
        for si, s in enumerate(host.slots):
            total += s.numel * s.param.element_size()
            total += sum(host.state[si][k].numel() * host.state[si][k].element_size()
                         for k in host.keys[si])
        return total

    def enqueue_group(self, job: Job, j: int) -> None:
        """Queue the copies of group j: they hold the version of the last completed update."""
        job.capture.tickets[j] = self.engine.submit(self._pairs(job, job.capture.groups[j - 1]),
                                                    STATE)

    def copy_at_f(self, job: Job) -> list:
        """At the boundary of F: copy the blocks planned to be copied directly at F, now
        (before anything of the next step can write them); returns them."""
        blocks = job.plan.blocks_at_f()
        if blocks:
            self.engine.submit(self._pairs(job, blocks), GRADIENT).wait()
            job.capture.captured.extend(blocks)
        return blocks

    def _pairs(self, job: Job, blocks) -> list:
        """(host destination, live source) of every tensor of ``blocks``: the parameter and its
        aligned state (zeros where the optimizer has none yet)."""
        host, plan = job.host, job.plan
        pairs = []
        for b in blocks:
            slot = plan.slots[b.slot]
            s, e = b.start, b.end
            pairs.append((host.param[b.slot][s:e], flat(slot.param, slot.dims)[s:e]))
            live = self.optimizer.state.get(slot.param, {})
            for key in host.keys[b.slot]:
                dst = host.state[b.slot][key][s:e]
                if key in live:
                    pairs.append((dst, flat(live[key], slot.dims)[s:e]))
                else:
                    dst.zero_()  # no state yet: the replayed first update starts from zeros
        return pairs

    def land_group(self, job: Job, j: int) -> None:
        """update_begin of window step j: group j's copies must have landed (they hold the
        version before this step's update)."""
        ticket = job.capture.tickets.get(j)
        if ticket is not None:
            ticket.wait()
            job.capture.captured.extend(job.capture.groups[j - 1])

    def copy_rest(self, job: Job) -> None:
        """Copy every block not yet captured now, blocking (sync/async, or close())."""
        book = job.capture
        for j in range(1, job.k + 1):
            if j not in book.tickets:
                self.enqueue_group(job, j)
        for j in range(1, job.k + 1):
            book.tickets[j].wait()
        book.captured = [b for g in book.groups for b in g]
        job.captured()

    def freeze_small(self, job: Job, step: int, extra_state) -> None:
        """Encode everything small at the boundary of F (tensors apart, no pickle)."""
        if callable(extra_state):
            extra_state = extra_state()
        aligned = {}
        for si, s in enumerate(job.plan.slots):
            if not s.static and s.param in self.optimizer.state:
                aligned[s.opt_index] = job.host.keys[si]
        job.capture.aligned = aligned
        tensors: Dict[str, torch.Tensor] = {}
        planned = [id(s.param) for s in job.plan.slots]
        values = {
            "model": smallstate.model_small(self.model, planned),
            "optimizer": smallstate.optimizer_small(self.optimizer, aligned),
            "scheduler": smallstate.scheduler_state(self.scheduler),
            "rng": smallstate.capture_rng(),
            "extra_state": extra_state,
        }
        try:
            small = SmallSection(**{section: tree.encode(value, tensors, small_prefix(section))
                                    for section, value in values.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot store the state of step {step}: {exc}") from exc
        job.capture.small, job.capture.small_tensors = small, tensors

    def gradients(self, job: Job, j: int, grad_pool: GradPool) -> Optional[StepRecord]:
        """Queue the copies of this step's gradients for the blocks captured so far; the
        record to replay, or None when GradScaler skips the step (nothing changes)."""
        if self.adapter.skipped_by_scaler():
            return None
        why = self.adapter.unsupported_step()
        if why:
            raise ConfigError(f"this optimizer step cannot be replayed: {why}")
        if j in job.capture.recorded:
            raise HookOrderError("optimizer.step() ran twice in one training step; gockpt "
                                 "supports one optimizer step per save_checkpoint() boundary")
        job.capture.recorded.add(j)
        steps = {}
        for si, s in enumerate(job.plan.slots):
            g = s.param.grad
            if s.static or g is None:
                continue
            if g.is_sparse or g.dtype != s.param.dtype:
                raise ConfigError(f"the gradient of {s.name!r} is sparse or {g.dtype}; the "
                                  f"replay needs dense {s.param.dtype} gradients")
            steps[si] = self.adapter.step_count(s.param)
        blocks = [b for b in job.capture.captured if b.slot in steps]
        bufs = grad_pool.acquire()
        pairs, flats = [], {}
        for b in blocks:
            slot = job.plan.slots[b.slot]
            g = flats.get(b.slot)
            if g is None:  # the parameter's memory order (a copy if the gradient's differs)
                g = flats[b.slot] = flat(slot.param.grad, slot.dims)
            pairs.append((grad_pool.buffer(bufs, b.slot, g)[b.start:b.end], g[b.start:b.end]))
        ticket = self.engine.submit(pairs, GRADIENT)
        record = StepRecord(j, self.adapter.scalars(), steps, blocks, bufs,
                            torch.get_num_threads(), ticket,
                            lambda bufs=bufs: grad_pool.release(bufs), ticket.nbytes,
                            final=j == job.k - 1)
        job.metrics.grad_bytes += ticket.nbytes
        job.capture.grad_tickets.append(ticket)
        return record
