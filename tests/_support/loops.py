"""Training loops as users write them, for the never-wrong tests: a runner that checkpoints
with gockpt, snapshots the live state at every checkpoint's F, and compares what loads.

Comparisons are bitwise and layout-aware (a channels_last tensor must come back with its
strides)."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch

import gockpt


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns in logical order (any dtype, any strides)."""
    t = t.detach().contiguous()
    return t.reshape(1).view(torch.uint8) if t.dim() == 0 else t.view(torch.uint8)


def same(a, b, path: str = "state") -> Optional[str]:
    """None if ``a`` and ``b`` are bitwise equal (tensors also in dtype, shape and strides),
    else where they first differ."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {getattr(b, 'dtype', type(b))}"
        if a.dim() and a.stride() != b.stride():
            return f"{path}: strides {a.stride()} vs {b.stride()}"
        return None if torch.equal(bits(a), bits(b)) else f"{path}: values differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{path}: keys differ"
        for k in a:
            why = same(a[k], b[k], f"{path}[{k!r}]")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = same(x, y, f"{path}[{i}]")
            if why:
                return why
        return None
    return None if a == b or (a != a and b != b) else f"{path}: {a!r} != {b!r}"


def state(model, opt) -> dict:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(opt.state_dict())}


class Run:
    """Train ``model`` with ``opt`` under a Checkpointer and remember the state at every F.

    ``step_fn(step)`` does one step's forward and returns the loss; ``between(step)`` runs
    after ``optimizer.step()`` and before ``save_checkpoint`` (clamps, second optimizers...)."""

    def __init__(self, model, opt, directory, *, step_fn: Callable[[int], torch.Tensor],
                 between: Optional[Callable[[int], None]] = None, **options):
        self.model, self.opt = model, opt
        self.step_fn, self.between = step_fn, between
        self.ck = gockpt.Checkpointer(model, opt, str(directory), **options)
        self.handles: List = []
        self.at_f: Dict[int, dict] = {}
        self.errors: List[BaseException] = []

    def train(self, start: int, stop: int, force=(), at=()) -> None:
        """Steps [start, stop): checkpoints announced at the steps ``at`` (the replay modes
        copy over the K steps up to each) and forced at ``force`` (copied at once)."""
        for step in at:
            self.ck.plan_checkpoint(step)
        for step in range(start, stop):
            loss = self.step_fn(step)
            self.ck.backward_begin()
            loss.backward()
            self.ck.update_begin()
            self.opt.step()
            self.opt.zero_grad()
            if self.between is not None:
                self.between(step)
            try:
                h = self.ck.save_checkpoint(step + 1, force=(step + 1) in force)
            except gockpt.GockptError as exc:
                self.errors.append(exc)
                h = None
            if h is not None:
                self.handles.append(h)
            if any(step + 1 == x.final_step for x in self.handles):
                self.at_f[step + 1] = state(self.model, self.opt)

    def close(self) -> None:
        try:
            self.ck.close()
        except gockpt.GockptError as exc:
            self.errors.append(exc)

    def committed(self) -> List[int]:
        """Final steps of the checkpoints that were committed."""
        return [h.final_step for h in self.handles if h.done() and h.error is None]


def overwrite_gradients(model, how: str, backward_again: Callable[[], None]) -> None:
    """What loops do to ``.grad`` in place between steps: ``model.zero_grad`` (not to None),
    ``grad.zero_`` on each parameter, or ``accumulate``: another backward into the same
    ``.grad`` (``backward_again()``), zeroed before the next step."""
    if how == "model.zero_grad":
        model.zero_grad(set_to_none=False)
        return
    if how == "accumulate":
        backward_again()
    for p in model.parameters():
        p.grad.zero_()


def loaded(directory, model, opt, tag: Optional[str] = None) -> dict:
    """The state a fresh ``model``/``opt`` holds after gockpt.load."""
    gockpt.load(str(directory), model, opt, tag=tag, restore_rng=False)
    return state(model, opt)
