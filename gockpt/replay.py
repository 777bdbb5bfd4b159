"""Optimizer replay: per-step records of what an update consumed, and the thread that
applies them to blocks captured at older versions until every block reaches version F.

An *adapter* knows one optimizer arithmetic. It refuses, at attach time, any setting it cannot
reproduce bitwise; at each optimizer step it turns the live param groups and state into plain
scalars; and it applies a step to a block through the C++ kernel.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .config import NO_REPLAY_MODES
from .errors import UnsupportedOptimizerError
from .plan import Block


@dataclass(frozen=True)
class GroupScalars:
    """Hyperparameters of one param group as one update used them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    impl: str          # "single" | "foreach" | "fused"
    decoupled: bool    # AdamW-style weight decay


@dataclass
class StepRecord:
    """One optimizer step, as needed to replay it on the blocks captured before it."""

    step_index: int                      # 1-based step within the checkpoint
    scalars: Dict[int, GroupScalars]     # param group -> scalars
    steps: Dict[int, float]              # slot -> t (step count after the increment)
    blocks: List[Block]                  # captured blocks whose param had a gradient
    grads: Dict[int, torch.Tensor]       # slot -> host gradient buffer (full length)
    torch_threads: int
    ticket: object = None                # transfer ticket of the gradient copies
    release: object = None               # returns the gradient buffer to its pool
    nbytes: int = 0
    final: bool = False                  # the update that produces version F


def _refuse(optimizer, why: str):
    modes = ", ".join(NO_REPLAY_MODES)
    raise UnsupportedOptimizerError(
        f"{type(optimizer).__name__}: {why}. The gockpt modes replay optimizer steps and only "
        "do so where the replay is bitwise exact (torch.optim.Adam/AdamW with float lr and "
        "betas, no amsgrad/maximize/capturable/differentiable, float32 parameters). Use one of "
        f"the modes that need no replay: {modes}.")


class AdamAdapter:
    """torch.optim.Adam and torch.optim.AdamW on CPU float32 tensors, in their default
    (single-tensor), foreach and fused implementations."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer: torch.optim.Optimizer):
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            _refuse(optimizer, "no bitwise replay exists for this optimizer class")
        self.optimizer = optimizer
        for gi, g in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if g.get(flag, False):
                    _refuse(optimizer, f"param group {gi} sets {flag}=True")
            for key in ("lr", "eps", "weight_decay"):
                if isinstance(g.get(key), torch.Tensor):
                    _refuse(optimizer, f"param group {gi} has a tensor {key}")
            if any(isinstance(b, torch.Tensor) for b in g["betas"]):
                _refuse(optimizer, f"param group {gi} has tensor betas")
            for p in g["params"]:
                if p.dtype != torch.float32:
                    _refuse(optimizer, f"a parameter of group {gi} is {p.dtype}, not float32")
                if p.device.type != "cpu":
                    _refuse(optimizer, "the bitwise replay is proven for CPU training tensors; "
                                       f"a parameter lives on {p.device}")
        from . import _kernels

        ok, reason = _kernels.exactness_supported()
        if not ok:
            _refuse(optimizer, f"this torch build cannot be replayed exactly ({reason})")
        for gi, sc in self.scalars().items():
            if not _probe(type(optimizer), sc):
                _refuse(optimizer, f"a probe replay of param group {gi}'s settings ({sc}) "
                                   f"differs from torch {torch.__version__} on this machine")

    def scalars(self) -> Dict[int, GroupScalars]:
        """The scalars every group's update uses right now (call inside the step pre-hook)."""
        out = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            if g.get("fused"):
                impl = "fused"
            elif g.get("foreach"):
                impl = "foreach"
            else:
                impl = "single"  # torch's default on CPU tensors
            decoupled = bool(g.get("decoupled_weight_decay",
                                   isinstance(self.optimizer, torch.optim.AdamW)))
            out[gi] = GroupScalars(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                                   float(g["eps"]), float(g["weight_decay"]), impl, decoupled)
        return out

    def step_count(self, param: torch.Tensor) -> float:
        """t of the update about to run on ``param`` (torch increments before using it)."""
        st = self.optimizer.state.get(param)
        if not st or "step" not in st:
            return 1.0
        return float(st["step"]) + 1.0

    def skipped_by_scaler(self) -> bool:
        """A fused step with GradScaler's found_inf set returns before touching any state."""
        found_inf = getattr(self.optimizer, "found_inf", None)
        return found_inf is not None and float(found_inf) != 0.0

    def unsupported_step(self) -> Optional[str]:
        """Why the step about to run cannot be replayed (None if it can)."""
        if getattr(self.optimizer, "grad_scale", None) is not None:
            return ("the fused optimizer is unscaling gradients itself (GradScaler.step without "
                    "unscale_); call scaler.unscale_(optimizer) before ck.update_begin()")
        return None

    def apply(self, record: StepRecord, block: Block, host, threads: Optional[int]) -> None:
        """Apply one recorded step to one block of the host copy, in place."""
        from . import _kernels

        slot = host.slots[block.slot]
        sc = record.scalars[slot.group]
        s, e = block.start, block.end
        _kernels.adam_replay(
            host.param[block.slot][s:e], host.state[block.slot]["exp_avg"][s:e],
            host.state[block.slot]["exp_avg_sq"][s:e], record.grads[block.slot][s:e],
            impl=sc.impl, decoupled=sc.decoupled, lr=sc.lr, beta1=sc.beta1, beta2=sc.beta2,
            eps=sc.eps, weight_decay=sc.weight_decay, step=record.steps[block.slot],
            offset=s, full_numel=slot.numel, torch_threads=record.torch_threads,
            threads=threads)


_PROBED: Dict[tuple, bool] = {}


def _probe(cls, sc: GroupScalars) -> bool:
    """Replay three steps of a small random problem and compare with torch itself: refuses
    a torch version or CPU whose arithmetic differs, at attach time instead of at F."""
    from . import _kernels

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
        _kernels.adam_replay(*mine, p.grad, impl=sc.impl, decoupled=sc.decoupled, lr=sc.lr,
                             beta1=sc.beta1, beta2=sc.beta2, eps=sc.eps,
                             weight_decay=sc.weight_decay, step=float(t), threads=1)
        opt.step()
    st = opt.state[p]
    ok = all(torch.equal(a, b) for a, b in
             zip(mine, (p.detach(), st["exp_avg"], st["exp_avg_sq"])))
    _PROBED[key] = ok
    return ok


def adapter_for(optimizer: torch.optim.Optimizer) -> AdamAdapter:
    """The replay adapter for ``optimizer``; raises UnsupportedOptimizerError if none is exact."""
    return AdamAdapter(optimizer)


class Replayer:
    """Background thread applying step records in arrival order.

    Records are applied as soon as their gradients have landed, so host memory holds the
    state plus the gradients in flight, never K steps of gradients.
    """

    def __init__(self, adapter: AdamAdapter, threads: Optional[int]):
        self.adapter = adapter
        self.threads = threads
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gockpt-replay", daemon=True)
        self._thread.start()

    def submit(self, record: StepRecord, job) -> None:
        """Queue ``record`` for the checkpoint ``job`` (which owns the host copy)."""
        self._queue.put((record, job))

    def barrier(self, callback) -> None:
        """Run ``callback()`` on the replay thread after everything queued so far."""
        self._queue.put((None, callback))

    def _run(self):
        while True:
            record, job = self._queue.get()
            if record is None and job is None:
                return
            if record is None:
                job()
                continue
            try:
                record.ticket.wait()
                if job.error is None:
                    t0 = time.perf_counter()
                    for block in record.blocks:
                        self.adapter.apply(record, block, job.host, self.threads)
                        if record.final and job.on_final is not None:
                            job.on_final(job, block)  # at F: may be written right away
                    job.metrics.replay_s += time.perf_counter() - t0
            except BaseException as exc:
                job.fail(exc)
            finally:
                record.release()

    def close(self):
        self._queue.put((None, None))
        self._thread.join()
