"""Host memory for checkpoints, planned once and reused: a staging copy of every slot
(parameter + aligned optimizer state) and a small pool of gradient buffers."""

from __future__ import annotations

import threading
from typing import Dict, List

import torch

from .plan import Plan


class HostCopy:
    """One host copy of the model's parameters and their aligned optimizer state.

    Buffers are allocated on first use per (slot, state key) and reused by every later
    checkpoint, so host memory stays at one copy of the state (plus gradients in flight).
    """

    def __init__(self, plan: Plan, device):
        self.slots = plan.slots
        self.device = device
        self.param: List[torch.Tensor] = [device.empty(s.numel, s.param.dtype) for s in plan.slots]
        self.state: List[Dict[str, torch.Tensor]] = [{} for _ in plan.slots]
        self.keys: List[tuple] = [() for _ in plan.slots]  # aligned keys of this checkpoint

    def set_keys(self, slot: int, likes: Dict[str, torch.Tensor]) -> None:
        """Declare the aligned state keys this checkpoint carries for ``slot`` (key -> a
        tensor of the dtype its buffer needs); buffers are reused while the dtype fits."""
        for key, like in likes.items():
            buf = self.state[slot].get(key)
            if buf is None or buf.dtype != like.dtype:
                self.state[slot][key] = self.device.empty(self.slots[slot].numel, like.dtype)
        self.keys[slot] = tuple(likes)

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.param)
        for st in self.state:
            total += sum(t.numel() * t.element_size() for t in st.values())
        return total


class GradPool:
    """A few full-length host gradient buffers, handed out one per recorded step and
    returned by the replay thread once that step has been applied."""

    SIZE = 2  # one set being filled while the replay applies the previous one

    def __init__(self, plan: Plan, device, size: int = SIZE):
        self.plan = plan
        self.device = device
        self._sets: List[Dict[int, torch.Tensor]] = [{} for _ in range(size)]
        self._free: List[Dict[int, torch.Tensor]] = list(self._sets)
        self._cv = threading.Condition()

    def acquire(self) -> Dict[int, torch.Tensor]:
        """A free buffer set (blocks while the replay still uses all of them)."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            return self._free.pop()

    def buffer(self, bufs: Dict[int, torch.Tensor], slot: int, grad: torch.Tensor) -> torch.Tensor:
        buf = bufs.get(slot)
        if buf is None or buf.dtype != grad.dtype:
            buf = bufs[slot] = self.device.empty(self.plan.slots[slot].numel, grad.dtype)
        return buf

    def release(self, bufs: Dict[int, torch.Tensor]) -> None:
        with self._cv:
            self._free.append(bufs)
            self._cv.notify()

    def nbytes(self) -> int:
        with self._cv:
            return sum(t.numel() * t.element_size() for b in self._sets for t in b.values())

