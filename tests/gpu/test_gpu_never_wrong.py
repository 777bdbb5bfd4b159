"""On a CUDA GPU, what the CPU's never-wrong and partial-replay tests prove there: a write
outside the optimizer inside a window is caught by the verification (digests on the device),
no gradient is read after the loop overwrote it (the copies are asynchronous on a side stream),
and fused AdamW at odd element counts -- whose parameter line the replay does not reproduce --
commits the state at F by copying those parameters at F, and only because it does. Skipped
where torch.cuda.is_available() is false."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gockpt import storage
from gockpt.core.plan import Plan

from tests._support import gpu_common as G
from tests._support.loops import Run, loaded, overwrite_gradients, same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on a GPU machine)")


def inputs(n=24):
    return [G.batch(s) for s in range(n)]


def loss_of(model, ids):
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def commits_are_the_state_at_f(run, directory, build):
    """The final steps of the committed checkpoints whose loaded state differs from the live
    state at their F (none, for a right checkpointer)."""
    wrong = []
    for f in run.committed():
        model, opt, _ = build()
        if same(run.at_f[f], loaded(directory, model, opt,
                                    tag=storage.checkpoint_name(f))) is not None:
            wrong.append(f)
    return wrong


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_clamp_after_the_step_is_caught_by_the_verification_on_the_gpu(tmp_path, impl):
    model, opt, _ = G.build(impl)
    xs = inputs()

    def clamp(step):
        with torch.no_grad():
            model.body[0].weight.clamp_(-0.05, 0.05)  # outside the optimizer, after its step

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=4096,
              verify=True, step_fn=lambda s: loss_of(model, xs[s]), between=clamp)
    run.train(0, 20, at={4, 11})
    run.close()
    assert commits_are_the_state_at_f(run, tmp_path, lambda: G.build(impl, seed=1)) == []
    assert run.handles[0].error is not None and "body.0.weight" in str(run.handles[0].error)
    assert run.committed() == [run.handles[1].final_step]


@pytest.mark.parametrize("zeroing", ["model.zero_grad", "grad.zero_", "accumulate"])
def test_no_gradient_is_read_after_the_loop_overwrote_it_on_the_gpu(tmp_path, zeroing):
    """The gradient copies run on a side stream: without their ordering they could still be
    reading .grad when the loop zeroes it (or accumulates into it) in place."""
    model, opt, _ = G.build("fused")
    xs = inputs()

    def between(step):
        overwrite_gradients(model, zeroing, lambda: loss_of(model, xs[step + 1]).backward())

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=4, block_bytes=4096,
              verify=True, step_fn=lambda s: loss_of(model, xs[s]), between=between)
    run.opt.zero_grad = lambda set_to_none=True: None  # the loop's own zeroing instead
    run.train(0, 12, at={5, 10})
    run.close()
    assert not run.errors and run.committed() == [5, 10]
    assert commits_are_the_state_at_f(run, tmp_path, lambda: G.build("fused", seed=1)) == []


class Odd(nn.Module):
    """Biases of 63 and 5 elements: fused CUDA AdamW's parameter line at numel % 4 != 0 is
    not reproduced by the replay (docs/arithmetics.md), its moments are."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up, self.down = nn.Linear(32, 63), nn.Linear(63, 32)
        self.side = nn.Linear(32, 5)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(h) + self.side(h).sum(-1, keepdim=True)


def build_odd(seed=0):
    torch.manual_seed(seed)
    model = Odd().cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                                    fused=True), None


def train_odd(tmp_path, mode):
    model, opt, _ = build_odd()
    xs = inputs()
    run = Run(model, opt, tmp_path, mode=mode, overlap_steps=3, block_bytes=1024, verify=True,
              step_fn=lambda s: loss_of(model, xs[s]))
    run.train(0, 14, at={5, 9, 13})
    run.close()
    return run


@pytest.mark.parametrize("mode", ["gockpt", "gockpt-o"])
def test_fused_adamw_at_odd_counts_copies_those_parameters_at_f(tmp_path, mode):
    run = train_odd(tmp_path, mode)
    late = [s.name for s in run.ck.plan.slots if s.param_at_f]
    assert late == [n for n, p in run.model.named_parameters() if p.numel() % 4]
    assert late == ["up.bias", "side.bias"]
    assert not run.errors and run.committed() == [5, 9, 13]
    assert commits_are_the_state_at_f(run, tmp_path, build_odd) == []


def test_without_the_copy_at_f_the_verification_refuses_them_on_the_gpu(tmp_path, monkeypatch):
    """The copy at F is what makes those checkpoints right: without it (the last group's
    parameter table being the group's own) the odd parameters are stale at F and the
    verification on the device refuses every replayed checkpoint."""
    monkeypatch.setattr(Plan, "group_param_tables", Plan.group_tables)
    with pytest.warns(UserWarning, match="was not committed"):
        run = train_odd(tmp_path, "gockpt-o")
    refused = [h for h in run.handles if h.error is not None]
    assert refused and all("differ" in str(h.error) for h in refused)
    assert commits_are_the_state_at_f(run, tmp_path, build_odd) == []
