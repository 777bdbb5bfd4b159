"""Never a wrong checkpoint: the loops users really write, each ending in a checkpoint that is
bitwise the live state at F, or in a clear refusal -- never a committed wrong one."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import gockpt
from gockpt import storage

from loops import Run, loaded, same

MODES = [("sync", None), ("async", None), ("async-o", None), ("gockpt", 2), ("gockpt-o", 3)]


def assert_every_commit_is_state_at_f(run: Run, directory, fresh) -> int:
    """Each committed checkpoint loads as exactly the live state at its F; returns how many."""
    committed = run.committed()
    for f in committed:
        model, opt = fresh()
        why = same(run.at_f[f], loaded(directory, model, opt, tag=storage.checkpoint_name(f)))
        assert why is None, f"checkpoint of step {f}: {why}"
    return len(committed)


# ------------------------------------------------------------------ memory layouts

class Layouts(nn.Module):
    """A channels_last convolution and a parameter built from a transposed tensor."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.proj = nn.Parameter(torch.randn(8, 5).t().contiguous().t())  # strides (1, 8)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = self.conv(x).mean((2, 3)) @ self.proj
        return self.head(h)


def layouts(impl="single"):
    torch.manual_seed(0)
    model = Layouts()
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)


@pytest.mark.parametrize("mode,k", MODES)
@pytest.mark.parametrize("impl", ["single", "fused"])
def test_any_dense_layout_works_in_every_mode(tmp_path, mode, k, impl):
    model, opt = layouts(impl)
    assert not model.conv.weight.is_contiguous() and not model.proj.is_contiguous()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
              for _ in range(10)]
    run = Run(model, opt, tmp_path, mode=mode, overlap_steps=k, block_bytes=256,
              self_check=1.0, step_fn=lambda s: model(inputs[s]).square().mean())
    run.train(0, 10, force={2, 6})
    run.close()
    assert not run.errors
    assert assert_every_commit_is_state_at_f(run, tmp_path, lambda: layouts(impl)) == 2
    fresh, _ = layouts(impl)
    gockpt.load(str(tmp_path), fresh, restore_rng=False)
    assert fresh.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert fresh.proj.stride() == model.proj.stride()


def test_a_layout_change_mid_training_is_a_clear_error(tmp_path):
    model, opt = layouts()
    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=2,
              step_fn=lambda s: model(torch.randn(2, 3, 6, 6)).sum())
    run.train(0, 3)
    model.conv.weight.data = model.conv.weight.data.contiguous()
    run.train(3, 4, force={4})
    run.close()
    assert len(run.errors) == 1 and isinstance(run.errors[0], gockpt.LayoutChangedError)
    assert "'conv.weight' changed its memory layout" in str(run.errors[0])
    assert run.handles == [] and storage.list_checkpoints(str(tmp_path)) == []


def test_a_non_dense_parameter_is_refused_with_what_to_do(tmp_path):
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.randn(4, 8)[:, ::2])  # holes: not dense
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(gockpt.ConfigError, match="not dense.*param.data.contiguous"):
        gockpt.Checkpointer(model, opt, str(tmp_path), mode="sync")
    assert not os.path.exists(os.path.join(tmp_path, "latest"))
