"""What one optimizer step consumed, as plain data: the scalars of each param group and the
record of the gradients copied for the replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch

from ..capture.plan import Block


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
