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


# ------------------------------------------------------------------ one writer per directory

def small_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_second_checkpointer_on_the_same_directory_is_refused(tmp_path):
    model, opt = small_model()
    first = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async")
    other, other_opt = small_model()
    with pytest.raises(gockpt.DirectoryInUseError, match=f"pid {os.getpid()} on host"):
        gockpt.Checkpointer(other, other_opt, str(tmp_path), mode="async")
    first.close()
    gockpt.Checkpointer(other, other_opt, str(tmp_path), mode="async").close()  # free again


HOLDER = r"""
import sys, torch, gockpt
model = torch.nn.Linear(2, 2)
ck = gockpt.Checkpointer(model, torch.optim.AdamW(model.parameters()), sys.argv[1], mode="sync")
print("locked", flush=True)
sys.stdin.read()   # hold the lock until killed
"""


def test_a_second_process_is_refused_until_the_holder_dies(tmp_path):
    import signal
    import subprocess
    import sys
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        model, opt = small_model()
        with pytest.raises(gockpt.DirectoryInUseError, match=f"pid {holder.pid} on host"):
            gockpt.Checkpointer(model, opt, str(tmp_path), mode="sync")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="sync")  # no stale lock
    ck.close()


def test_the_directory_is_made_absolute_before_the_loop_changes_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = small_model()
    run = Run(model, opt, "run1", mode="gockpt-o", overlap_steps=2,
              step_fn=lambda s: model(torch.ones(3, 6) * s).square().mean())
    os.mkdir("elsewhere")
    os.chdir("elsewhere")  # the training script moves
    run.train(0, 6, force={2})
    run.close()
    assert run.committed() == [3] and not run.errors
    assert storage.list_checkpoints(str(tmp_path / "run1")) == ["step-000000003"]
    assert not os.path.exists(tmp_path / "elsewhere" / "run1")
    assert assert_every_commit_is_state_at_f(run, tmp_path / "run1", small_model) == 1


# ------------------------------------------------------------------ a way on after an exception

class FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time (an OOM in backward, say)."""

    raised = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if not FailOnce.raised:
            FailOnce.raised = True
            raise RuntimeError("backward failed")
        return g


@pytest.mark.parametrize("mode,k", [("gockpt-o", 3), ("gockpt", 2), ("async-o", None)])
def test_backward_raising_after_backward_begin_then_skipping_the_batch(tmp_path, mode, k):
    model, opt = small_model()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=k,
                             self_check=1.0)
    FailOnce.raised = False
    at_f, handles = {}, []
    step = 0
    for batch in range(9):
        loss = FailOnce.apply(model(torch.ones(3, 6) * batch)).square().mean()
        ck.backward_begin()
        try:
            loss.backward()
        except RuntimeError:
            opt.zero_grad()
            continue  # skip the batch: the next backward_begin() starts afresh
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        step += 1
        h = ck.save_checkpoint(step, force=step == 2)
        handles += [h] if h else []
        if any(step == x.final_step for x in handles):
            from loops import state
            at_f[step] = state(model, opt)
    ck.close()
    assert FailOnce.raised and [h.final_step for h in handles if h.error is None] == \
        [2 + (k or 1) - 1]
    f = handles[0].final_step
    fresh, fresh_opt = small_model()
    assert same(at_f[f], loaded(tmp_path, fresh, fresh_opt)) is None


@pytest.mark.parametrize("mode,k", [("gockpt-o", 3), ("gockpt", 3), ("async-o", None)])
def test_a_skipped_optimizer_step_counts_as_a_skipped_step(tmp_path, mode, k):
    """A NaN guard: update_begin() then no optimizer.step(); save_checkpoint() as usual."""
    model, opt = small_model()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=k,
                             self_check=1.0)
    at_f, handles = {}, []
    for step in range(8):
        loss = model(torch.ones(3, 6) * step).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        if step != 3:  # the guard finds a NaN in step 3 and skips the update
            opt.step()
        opt.zero_grad()
        h = ck.save_checkpoint(step + 1, force=step + 1 == 2)
        handles += [h] if h else []
        if any(step + 1 == x.final_step for x in handles):
            from loops import state
            at_f[step + 1] = state(model, opt)
    ck.close()
    f = handles[0].final_step
    assert handles[0].error is None and f == 2 + (k or 1) - 1
    fresh, fresh_opt = small_model()
    assert same(at_f[f], loaded(tmp_path, fresh, fresh_opt)) is None
