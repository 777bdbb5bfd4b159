"""The frameworks users wrap their models in: what gockpt supports works, what it does not
support yet is refused at construction with a clear error -- never a silently wrong checkpoint.
Multi-rank cases run real gloo ranks (tests/frameworks_worker.py)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import gockpt
from dist_ranks import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frameworks_worker.py")


def test_fsdp2_is_refused_in_every_mode_on_two_ranks(tmp_path):
    run_ranks(tmp_path, "fsdp2-refused", world=2, worker=WORKER)


@pytest.mark.parametrize("mode", gockpt.MODES)
def test_tensors_without_addressable_memory_are_refused(tmp_path, mode):
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(gockpt.UnsupportedTensorError, match="'weight' has no data yet"):
        gockpt.Checkpointer(meta, torch.optim.AdamW(meta.parameters()), str(tmp_path), mode=mode)
    lazy = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(gockpt.UnsupportedTensorError, match="a lazy module"):
        gockpt.Checkpointer(lazy, torch.optim.AdamW(lazy.parameters()), str(tmp_path), mode=mode)
    gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=2).close()  # free
