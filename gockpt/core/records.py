"""What one optimizer step consumed, as plain data: the scalars of each param group and the
record of the gradients copied for the replay."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional

import numpy as np
import torch

from .blocks import Block

if TYPE_CHECKING:
    from .blocks import BlockTable


class Kernel(str, enum.Enum):
    """The update kernels the replay reproduces (a ``str``: ``Kernel.FUSED == "fused"``, the
    names :mod:`gockpt.replay.arithmetic` takes)."""

    SINGLE = "single"              # torch's CPU kernels: single-tensor (default),
    FOREACH = "foreach"            # foreach
    FUSED = "fused"                # and fused
    CUDA_FORLOOP = "cuda-forloop"  # torch's CUDA kernels
    CUDA_FOREACH = "cuda-foreach"
    CUDA_FUSED = "cuda-fused"
    DEEPSPEED_CPU_W1 = "deepspeed-cpu-w1"    # DeepSpeed's CPU Adam op built without SIMD,
    DEEPSPEED_CPU_W8 = "deepspeed-cpu-w8"    # with AVX256,
    DEEPSPEED_CPU_W16 = "deepspeed-cpu-w16"  # with AVX512 (its vector width)
    DEEPSPEED_CUDA_MOMENTS = "deepspeed-cuda-moments"  # DeepSpeed's CUDA FusedAdam: moments

    def __str__(self) -> str:
        return self.value

    @classmethod
    def deepspeed_cpu(cls, width: int) -> "Kernel":
        """DeepSpeed's CPU Adam op built with ``width`` float32 lanes."""
        return cls(f"deepspeed-cpu-w{width}")


@dataclass(frozen=True)
class GroupScalars:
    """Hyperparameters of one param group as one update used them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    impl: Kernel       # the kernel of the update (gockpt.replay.arithmetic runs it)
    decoupled: bool    # AdamW-style weight decay
    beta1_power: float = 0.0  # DeepSpeed's CPU op: its running beta1^t, beta2^t (0: unused)
    beta2_power: float = 0.0


class StepCounts(Mapping):
    """slot -> t of one update, as the step pre-hook read them: the slots and their counts
    kept as read (``plus`` added), the dict built where it is first looked up (the replay
    thread), not in the hook."""

    def __init__(self, slots, counts: np.ndarray, plus: float = 0.0):
        self._slots, self._counts = slots, counts  # slots: a list, or an int64 array
        self._plus = plus  # added to every count (t: the counter read, plus one)
        self._by_slot: Optional[Dict[int, float]] = None

    def _built(self) -> Dict[int, float]:
        if self._by_slot is None:
            slots = self._slots
            self._by_slot = dict(zip(slots.tolist() if isinstance(slots, np.ndarray) else slots,
                                     (self._counts + self._plus).tolist()))
        return self._by_slot

    def __getitem__(self, slot: int) -> float:
        return self._built()[slot]

    def __iter__(self) -> Iterator[int]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())


@dataclass
class StepRecord:
    """One optimizer step, as needed to replay it on the blocks captured before it."""

    step_index: int                      # 1-based step within the checkpoint
    scalars: Dict[int, GroupScalars]     # param group -> scalars
    steps: Mapping                       # slot -> t (step count after the increment)
    table: "BlockTable"                  # captured blocks whose param had a gradient
    grads: Dict[int, torch.Tensor]       # the gradient buffer set (slot -> host buffer)
    grad_base: Optional[np.ndarray] = None  # per slot: address of its gradient in the set
    ticket: object = None                # transfer ticket of the gradient copies
    release: object = None               # returns the gradient buffer to its pool
    nbytes: int = 0
    final: bool = False                  # the update that produces version F
    snapshot: bool = False               # copied from a device-side snapshot of the gradients
    grad_dtype: torch.dtype = torch.float32  # bfloat16: a bf16 transport (capture/transport.py)
    grad_mul: float = 1.0                # bf16: the consumed gradient is float(g) * grad_mul

    @property
    def blocks(self) -> List[Block]:
        return self.table.blocks
