"""Never a wrong checkpoint: the loops users really write, each ending in a checkpoint that is
bitwise the live state at F, or in a clear refusal -- never a committed wrong one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

import gockpt
from gockpt import storage
from gockpt.testing import assert_same, snapshot

from tests._support.loops import Run, loaded, overwrite_gradients, same

# Patches the CPU device's own code, which the simulated asynchronous device
# (GOCKPT_SIMULATED_DEVICE, as .ci/run sets it for a second pass) does not run.
HOST_DEVICE_ONLY = pytest.mark.skipif(bool(os.environ.get("GOCKPT_SIMULATED_DEVICE")),
                                      reason="patches the CPU device's code")

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
    run.train(0, 10, at={4, 8})
    run.close()
    assert not run.errors
    assert assert_every_commit_is_state_at_f(run, tmp_path, lambda: layouts(impl)) == 2
    fresh, _ = layouts(impl)
    gockpt.load(str(tmp_path), fresh, restore_rng=False)
    assert fresh.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert fresh.proj.stride() == model.proj.stride()


def test_a_parameter_without_optimizer_state_yet_is_stored_in_any_layout(tmp_path):
    """A checkpoint of a model whose plan is not contiguous (its tensors read role by role)
    taken when some parameters have no optimizer state yet (not trained so far): their
    moments are copied from zeros, and the checkpoint loads as the state of its step."""
    model, opt = layouts()
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(3)).to(
        memory_format=torch.channels_last)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", block_bytes=256)
    ck.backward_begin()
    model.conv(x).square().mean().backward()  # (proj and head: no gradient, no state)
    ck.update_begin()
    opt.step()
    opt.zero_grad()
    ck.save_checkpoint(1, force=True).wait()
    assert len(opt.state) == 2
    at_1 = snapshot(model, opt)
    ck.backward_begin()
    model(x).square().mean().backward()
    ck.update_begin()
    opt.step()
    ck.save_checkpoint(2)
    ck.close()
    fresh, fresh_opt = layouts()
    gockpt.load(str(tmp_path), fresh, fresh_opt, tag=storage.checkpoint_name(1))
    assert_same(at_1, snapshot(fresh, fresh_opt))


@pytest.mark.parametrize("overlap_steps", [1, 2])
def test_a_state_created_between_two_checkpoints_is_in_the_second(tmp_path, overlap_steps):
    """The optimizer's state read at F is kept from one checkpoint to the next while no state
    dict was created or replaced: a parameter trained for the first time after a checkpoint
    has its state (moments and step count) in the next one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o",
                             overlap_steps=overlap_steps, interval=3)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    at = {}  # step -> the live state when its checkpoint was taken
    for step in range(1, 10):
        ck.backward_begin()
        (model(x) if step > 4 else model[0](x)).square().mean().backward()  # (model[1]: later)
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step)
        if step in (3, 6):
            ck.wait()
            assert len(opt.state) == (2 if step == 3 else 4)
            at[step] = snapshot(model, opt)
    ck.close()
    for step, state in at.items():
        torch.manual_seed(5)
        fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        gockpt.load(str(tmp_path), fresh, fresh_opt, tag=storage.checkpoint_name(step))
        assert_same(state, snapshot(fresh, fresh_opt))


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


@pytest.mark.parametrize("mode", ["gockpt-o", "async"])
def test_a_layout_change_of_a_contiguous_plan_is_a_clear_error(tmp_path, mode):
    # a contiguous plan's copies check each parameter's strides as they read it (the start
    # of a checkpoint leaves it to them): a parameter turned into a transposed view (of the
    # same shape: training goes on) is refused by name, nothing committed; the same in the
    # first or the second group of a window
    for change in ("0.weight", "1.weight"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        run = Run(model, opt, root, mode=mode, overlap_steps=2 if mode == "gockpt-o" else None,
                  step_fn=lambda s: sum(p.square().sum() for p in model.parameters()))
        run.train(0, 3)
        weight = model.get_parameter(change)
        weight.data = weight.data.t().contiguous().t()
        run.train(3, 4, force={4})
        run.close()
        assert len(run.errors) == 1 and isinstance(run.errors[0], gockpt.LayoutChangedError)
        assert f"'{change}' changed its memory layout" in str(run.errors[0])
        assert run.handles == [] and storage.list_checkpoints(str(root)) == []


@pytest.mark.parametrize("mode,k", [("gockpt", 2), ("gockpt-o", 3)])
@pytest.mark.parametrize("what", ["param", "state"])
def test_tensors_moved_to_new_memory_inside_a_window_are_read_where_they_are(tmp_path, mode,
                                                                               k, what):
    """``p.data = ...`` (FSDP does it; the Parameter object stays, its memory does not) or an
    optimizer state tensor put back as a copy, at every boundary of every window: each group
    copies what the tensors hold when it is queued, never through an address kept from an
    earlier group (that memory is freed by then) -- every checkpoint is the state at F."""
    model, opt = small_model()

    def move(step):
        for p in model.parameters():
            if what == "param":
                p.data = p.data.clone()
            elif p in opt.state:
                opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()

    run = Run(model, opt, tmp_path, mode=mode, overlap_steps=k, block_bytes=64,
              between=move, step_fn=lambda s: model(torch.randn(4, 6)).square().mean())
    run.train(0, 12, at={6, 10})
    run.close()
    assert not run.errors
    assert assert_every_commit_is_state_at_f(run, tmp_path, small_model) == 2


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
    run.train(0, 6, at={3})
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
    ck.plan_checkpoint(2 + (k or 1) - 1)
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
        h = ck.save_checkpoint(step)
        handles += [h] if h else []
        if any(step == x.final_step for x in handles):
            from tests._support.loops import state
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
    ck.plan_checkpoint(2 + (k or 1) - 1)
    for step in range(8):
        loss = model(torch.ones(3, 6) * step).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        if step != 3:  # the guard finds a NaN in step 3 and skips the update
            opt.step()
        opt.zero_grad()
        h = ck.save_checkpoint(step + 1)
        handles += [h] if h else []
        if any(step + 1 == x.final_step for x in handles):
            from tests._support.loops import state
            at_f[step + 1] = state(model, opt)
    ck.close()
    f = handles[0].final_step
    assert handles[0].error is None and f == 2 + (k or 1) - 1
    fresh, fresh_opt = small_model()
    assert same(at_f[f], loaded(tmp_path, fresh, fresh_opt)) is None


# ------------------------------------------------------------------ writers outside the optimizer

class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))
        self.d = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def gan(second="adamw"):
    torch.manual_seed(0)
    model = GAN()
    opt_g = torch.optim.AdamW(model.g.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(model.d.parameters(), lr=1e-2) if second == "adamw" else \
        torch.optim.SGD(model.d.parameters(), lr=1e-2, momentum=0.9)
    return model, opt_g, opt_d


@pytest.mark.parametrize("mode,k", [("gockpt-o", 3), ("gockpt", 2), ("async-o", None)])
@pytest.mark.parametrize("second", ["adamw", "sgd"])
def test_a_gan_with_two_optimizers_commits_the_live_state(tmp_path, mode, k, second):
    """G's optimizer is attached; D trains with its own optimizer: D's parameters are not the
    attached optimizer's, so they are copied at F."""
    from tests._support.loops import state
    model, opt_g, opt_d = gan(second)
    ck = gockpt.Checkpointer(model, opt_g, str(tmp_path), mode=mode, overlap_steps=k,
                             block_bytes=256)
    gen = torch.Generator().manual_seed(3)
    at_f, handles = {}, []
    for f in (2 + (k or 1) - 1, 7 + (k or 1) - 1):
        ck.plan_checkpoint(f)
    for step in range(12):
        real, z = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
        opt_d.zero_grad()
        (model.d(model.g(z).detach()).mean() - model.d(real).mean()).backward()
        opt_d.step()
        loss_g = -model.d(model.g(z)).mean()
        ck.backward_begin()
        loss_g.backward()  # also accumulates into D's .grad
        ck.update_begin()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        h = ck.save_checkpoint(step + 1)
        handles += [h] if h else []
        if any(step + 1 == x.final_step for x in handles):
            at_f[step + 1] = state(model, opt_g)
    ck.close()
    assert [h.error for h in handles] == [None, None]
    for h in handles:
        fresh, fresh_g, _ = gan(second)
        got = loaded(tmp_path, fresh, fresh_g, tag=storage.checkpoint_name(h.final_step))
        assert same(at_f[h.final_step], got) is None, h.final_step


def embedding_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 8, max_norm=1.0), nn.Flatten(), nn.Linear(24, 2))
    with torch.no_grad():
        model[0].weight.mul_(3)  # most rows beyond max_norm: forward renormalises them
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_in_place_renorm_in_forward_is_refused_then_copied_at_the_boundary(tmp_path):
    model, opt = embedding_model()
    ids = torch.randint(0, 40, (20, 4, 3), generator=torch.Generator().manual_seed(1))
    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=256,
              step_fn=lambda s: model(ids[s]).square().mean())
    with pytest.warns(UserWarning, match=r"0\.weight.*copied directly at the step boundary"):
        run.train(0, 20, at={4, 10, 16})
    run.close()
    # the first window is refused; step 4 is then copied at once (0.weight at the boundary)
    assert run.committed() == [4, 10, 16]
    assert not run.errors  # a warning, not an exception in the loop
    assert assert_every_commit_is_state_at_f(run, tmp_path, embedding_model) == 3


class WithShadow(nn.Module):
    """A frozen parameter the training's step writes (an average of the trained weight, as
    DeepSpeed writes its module weights from the fp32 masters): Config.step_written."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 2)
        self.shadow = nn.Parameter(torch.zeros(2, 16), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + 0.1 * (x @ self.shadow.t())


def shadow_model():
    torch.manual_seed(0)
    model = WithShadow()
    return model, torch.optim.AdamW(model.lin.parameters(), lr=5e-2)


@pytest.mark.parametrize("written_in_forward", [False, True])
def test_a_step_written_parameter_rides_with_the_last_group(tmp_path, written_in_forward):
    # written only between the update and the boundary: copied with the last group under the
    # next forward/backward, each checkpoint the state at F; written in forward instead (what
    # step_written promises not to do): that window is refused, the parameter is copied at the
    # boundary from then on, and nothing wrong is committed
    model, opt = shadow_model()
    x = torch.randn(24, 5, 16, generator=torch.Generator().manual_seed(2))

    def step_fn(s):
        if written_in_forward:
            with torch.no_grad():
                model.shadow.mul_(0.5)
        return model(x[s]).square().mean()

    def between(s):
        with torch.no_grad():
            model.shadow.mul_(0.9).add_(model.lin.weight, alpha=0.1)

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=256,
              step_written=["shadow"], step_fn=step_fn, between=between)
    plan = run.ck.plan
    assert not {b.slot for b in plan.blocks_at_f()} & \
        {si for si, sl in enumerate(plan.slots) if sl.name == "shadow"}
    if written_in_forward:
        with pytest.warns(UserWarning, match="shadow"):
            run.train(0, 20, at={5, 11, 17})
    else:
        run.train(0, 20, at={5, 11, 17})
    run.close()
    committed = run.committed()
    assert committed == ([11, 17] if written_in_forward else [5, 11, 17])
    assert assert_every_commit_is_state_at_f(run, tmp_path, shadow_model) == len(committed)
    assert any(sl.step_written for sl in plan.slots) != written_in_forward


def clamped_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=5e-2)


def clamp_first_weight(model):
    with torch.no_grad():
        model[0].weight.clamp_(-0.2, 0.2)  # outside the optimizer, after its step


@pytest.mark.parametrize("verify", [True, False])
def test_a_clamp_after_the_step_is_caught_by_the_verification(tmp_path, verify):
    """The same out-of-band writer with and without the verification: without it a wrong
    checkpoint is committed -- the test can fail -- with it, never."""
    model, opt = clamped_model()
    x = torch.randn(24, 5, 16, generator=torch.Generator().manual_seed(2))
    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=512,
              verify=verify, step_fn=lambda s: model(x[s]).square().mean(),
              between=lambda s: clamp_first_weight(model))
    run.train(0, 20, at={4, 11})
    run.close()
    wrong = []
    for f in run.committed():
        fresh, fresh_opt = clamped_model()
        if same(run.at_f[f], loaded(tmp_path, fresh, fresh_opt,
                                    tag=storage.checkpoint_name(f))) is not None:
            wrong.append(f)
    if verify:
        assert wrong == [] and run.committed() == [run.handles[1].final_step]
        assert run.handles[0].error is not None and "0.weight" in str(run.handles[0].error)
    else:  # without verification, every checkpoint is committed -- silently wrong
        assert wrong == run.committed() == [h.final_step for h in run.handles]


def wrong_source(monkeypatch, name: str, keep: list):
    """A copy path whose source address for parameter ``name`` is wrong (other memory of the
    right size, zeros): the fault the verification must catch whatever the mode -- and that
    every check reading through the copy's own addresses misses, since it reads the same
    wrong memory (FSDP2's DTensors were checkpointed as zeros that way)."""
    from gockpt.capture import copies
    real = copies.live_bases

    def live_bases(plan, states, slots, key, made):
        at, read = real(plan, states, slots, key, made)
        si = [s.name for s in plan.slots].index(name)
        row = np.flatnonzero(slots == si)
        if key is None and len(row) and at[row[0]]:
            zeros = torch.zeros(plan.slots[si].numel)
            keep.append(zeros)
            at = at.copy()  # (what the copy reads; the read tensors' own addresses stay)
            at[row[0]] = zeros.data_ptr()
        return at, read

    real_group = copies.group_sources

    def group_sources(plan, states, roles, lookup=None):  # (every role at once: the usual case)
        found = real_group(plan, states, roles, lookup)
        si = [s.name for s in plan.slots].index(name)
        param = roles[0]  # (the parameter's rows come first)
        rows = np.flatnonzero(param.slots[param.at] == si) if param.key is None else []
        if found is None or not len(rows):
            return found
        zeros = torch.zeros(plan.slots[si].numel)
        keep.append(zeros)
        src, columns, absent = found
        src = src.copy()
        src[rows] = zeros.data_ptr() + param.offset[rows]
        return src, columns, absent

    monkeypatch.setattr(copies, "live_bases", live_bases)
    monkeypatch.setattr(copies, "group_sources", group_sources)


@HOST_DEVICE_ONLY
@pytest.mark.parametrize("mode,k", MODES)
def test_a_copy_of_the_wrong_memory_is_never_committed(tmp_path, mode, k, monkeypatch):
    import warnings
    keep = []
    wrong_source(monkeypatch, "2.weight", keep)
    model, opt = clamped_model()
    x = torch.randn(24, 5, 16, generator=torch.Generator().manual_seed(2))
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=k,
                             block_bytes=512)
    for step in (4, 11):
        ck.plan_checkpoint(step)
    said, handles = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(14):
            for hook in ("backward_begin", "update_begin", "save_checkpoint"):
                if hook == "update_begin":
                    model(x[step]).square().mean().backward()
                try:
                    h = getattr(ck, hook)(*((step + 1,) if hook == "save_checkpoint" else ()))
                except gockpt.CheckpointFailedError as exc:  # surfaces at the next hook
                    said.append(str(exc))
                    h = None
                if hook == "update_begin":
                    opt.step()
                    opt.zero_grad()
                elif h is not None:
                    handles.append(h)
        try:
            ck.close()
        except gockpt.CheckpointFailedError as exc:
            said.append(str(exc))
    # (a save at which the first failure surfaces raises it instead of starting one)
    assert [h.final_step for h in handles] in ([4], [4, 11])
    assert all(h.error is not None for h in handles)
    assert storage.list_checkpoints(str(tmp_path)) == []  # nothing wrong was committed
    said += [str(w.message) for w in seen]
    assert any("staged copy of 2.weight differs" in m or "2.weight differ from their replay" in m
               for m in said), said


def backbone_model():
    torch.manual_seed(0)
    model = nn.ModuleDict({"backbone": nn.Linear(8, 8), "head": nn.Linear(8, 48)})
    return model, torch.optim.AdamW(model["head"].parameters(), lr=1e-2)


@pytest.mark.parametrize("when", [4, 6])  # inside a checkpoint's window; between two
def test_add_param_group_after_construction_plans_again(tmp_path, when):
    model, opt = backbone_model()
    x = torch.randn(20, 3, 8, generator=torch.Generator().manual_seed(4))

    def between(step):
        if step + 1 == when:
            opt.add_param_group({"params": model["backbone"].parameters(), "lr": 3e-3})

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=64,
              step_fn=lambda s: model["head"](torch.tanh(model["backbone"](x[s]))).sum(),
              between=between)
    if when == 4:
        with pytest.warns(UserWarning, match="the optimizer's parameters changed"):
            run.train(0, 16, at={5, 11})
    else:
        run.train(0, 16, at={5, 11})
    run.close()
    assert not run.errors
    # inside a window, the window fails and its step is taken anew (copied at once)
    assert [h.final_step for h in run.handles] == [5, 11]
    assert run.committed() == [5, 11]

    def fresh():
        m, o = backbone_model()
        o.add_param_group({"params": m["backbone"].parameters(), "lr": 3e-3})
        return m, o
    model_f, opt_f = fresh()
    got = loaded(tmp_path, model_f, opt_f, tag=storage.checkpoint_name(11))
    assert same(run.at_f[11], got) is None
    assert len(got["optim"]["state"]) == 4  # the backbone's moments are in it


@pytest.mark.parametrize("mode,k", [("gockpt", 2), ("gockpt-o", 3)])
@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("how", ["load_state_dict", "assign"])
def test_optimizer_state_reloaded_inside_a_window_is_refused(tmp_path, mode, k, inside, how):
    """A loop that reloads the optimizer's state mid-checkpoint (rolling back after a loss
    spike): the copies already taken read the replaced tensors, so that checkpoint is not
    committed (a warning says why); the next one reads the new state and is bitwise.
    Reloaded between two checkpoints, both are committed."""
    model, opt = small_model()
    x = torch.randn(16, 4, 6, generator=torch.Generator().manual_seed(2))
    saved = {}

    def between(step):
        if step == 1:
            saved["opt"] = {"state": {i: {k: v.clone() for k, v in st.items()}
                                      for i, st in opt.state_dict()["state"].items()},
                            "param_groups": opt.state_dict()["param_groups"]}
        if step + 1 == (4 if inside else 7):  # in the window started at 3, or after it
            if how == "load_state_dict":
                opt.load_state_dict(saved["opt"])
            else:  # one parameter's state dict replaced by a copy of it
                p = model[0].weight
                opt.state[p] = {key: v.clone() for key, v in opt.state[p].items()}

    run = Run(model, opt, tmp_path, mode=mode, overlap_steps=k, block_bytes=64,
              step_fn=lambda s: model(x[s]).square().mean(), between=between)
    if inside:
        with pytest.warns(UserWarning, match="optimizer state of .* was replaced"):
            run.train(0, 14, at={3 + k - 1, 9 + k - 1})
    else:
        run.train(0, 14, at={3 + k - 1, 9 + k - 1})
    run.close()
    assert not run.errors
    assert run.committed() == ([] if inside else [3 + k - 1]) + [9 + k - 1]
    assert assert_every_commit_is_state_at_f(run, tmp_path, small_model) == 2 - inside


def with_an_untrained_parameter():
    model, _ = small_model()
    model.unused = nn.Parameter(torch.zeros(3))  # in the optimizer, never a gradient
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_state_dropped_inside_a_window_is_refused_while_another_has_none(tmp_path):
    """A parameter's state dropped inside the window (its moments reset; the optimizer makes
    a new one at its next step) while another parameter never has one: the slots without a
    state are looked for again as states appear, and that must not hide the dropped one."""
    model, opt = with_an_untrained_parameter()
    x = torch.randn(16, 4, 6, generator=torch.Generator().manual_seed(2))

    def between(step):
        if step + 1 == 4:  # inside the window of the checkpoint started at 3
            del opt.state[model[0].weight]

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=64,
              step_fn=lambda s: model(x[s]).square().mean(), between=between)
    with pytest.warns(UserWarning, match="optimizer state of 0.weight was replaced"):
        run.train(0, 14, at={5, 11})
    run.close()
    assert not run.errors and run.committed() == [11]
    assert assert_every_commit_is_state_at_f(run, tmp_path, with_an_untrained_parameter) == 1


def test_a_failed_checkpoints_late_replay_never_reaches_the_next_one(tmp_path):
    """The interleaving behind a correct checkpoint refused on a busy machine, provoked on
    purpose: the replay thread takes a record of a checkpoint before that checkpoint fails
    (here: a state replaced inside its window), is held mid-record, and only goes on once
    the next checkpoint has either copied its first group into the same host staging (the
    old code: the late record then lands on those fresh copies and the verification refuses
    a correct checkpoint) or waits for the failed one to settle (the fix)."""
    import threading
    model, opt = with_an_untrained_parameter()
    x = torch.randn(16, 4, 6, generator=torch.Generator().manual_seed(2))
    entered, go = threading.Event(), threading.Event()
    first = []

    def between(step):
        if step + 1 == 4:  # inside the window of the checkpoint started at 3 (F = 5)
            del opt.state[model[0].weight]
        if step + 1 == 5:  # the last record of that checkpoint is in the replay's hands
            assert entered.wait(60), "the replay never took the record"

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=3, block_bytes=64,
              step_fn=lambda s: model(x[s]).square().mean(), between=between)
    ck = run.ck
    apply, land, settle = ck.replayer.adapter.apply, ck.capture.land_group, \
        getattr(ck.pipeline, "settle", None)

    def held_apply(record, host, threads):
        if not first:
            first.append(ck._job)
        if ck._job is first[0] and record.step_index == 2:  # checked before the failure
            entered.set()
            assert go.wait(60), "neither the next checkpoint's copy nor a settle came"
        return apply(record, host, threads)

    def watched_land(job, j):
        land(job, j)
        if first and job is not first[0] and j == 1:  # the next checkpoint's first group has landed
            go.set()

    def watched_settle(job):
        go.set()  # the next checkpoint waits for the failed one: let the record finish
        settle(job)

    ck.replayer.adapter.apply = held_apply
    ck.capture.land_group = watched_land
    if settle is not None:
        ck.pipeline.settle = watched_settle
    with pytest.warns(UserWarning, match="optimizer state of 0.weight was replaced") as seen:
        run.train(0, 14, at={5, 11})
    run.close()
    assert not [w for w in seen if "differ from their replay" in str(w.message)]
    assert not run.errors and run.committed() == [11]
    assert assert_every_commit_is_state_at_f(run, tmp_path, with_an_untrained_parameter) == 1


# ------------------------------------------------------------------ gradients stay put

@pytest.mark.parametrize("zeroing", ["model.zero_grad", "grad.zero_", "accumulate"])
def test_no_gradient_is_read_after_it_was_overwritten(tmp_path, zeroing):
    """The gradient copies run through a slow emulated link, so without ordering they would
    still be reading .grad when the loop zeroes it (or accumulates into it) in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8, 64, generator=torch.Generator().manual_seed(5))

    def between(step):
        overwrite_gradients(model, zeroing, lambda: model(x[step]).sum().backward())

    run = Run(model, opt, tmp_path, mode="gockpt-o", overlap_steps=4, block_bytes=4096,
              emulate_link_gbps=0.001, step_fn=lambda s: model(x[s]).square().mean(),
              between=between)
    # opt.zero_grad() in Run sets to None first: use the loop's own zeroing instead
    run.opt.zero_grad = lambda set_to_none=True: None
    run.train(0, 12, at={5, 10})
    run.close()
    assert not run.errors and len(run.committed()) == 2
    for f in run.committed():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        assert same(run.at_f[f], loaded(tmp_path, m, o, tag=storage.checkpoint_name(f))) is None


# ------------------------------------------------------------------ many small tensors

class Tiny(nn.Module):
    def __init__(self, n=2000):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(10)) for _ in range(n)])

    def forward(self):
        return torch.cat(list(self.ps)).square().sum()


def tiny():
    torch.manual_seed(0)
    model = Tiny()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_thousands_of_small_parameters_are_packed_and_every_hook_second_is_counted(tmp_path):
    import time
    model, opt = tiny()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=2)
    # Nested clocks, so that no verdict depends on how busy the machine is: the checkpoint
    # work a hook does (the pipeline's calls) lies inside the library's count of that hook,
    # which lies inside the loop's clock around the call.
    spent = {"save_checkpoint": 0.0, "update_begin": 0.0, "backward_begin": 0.0}
    work = dict.fromkeys(spent, 0.0)
    this_call = {"work": 0.0}

    def clocked(fn):
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                this_call["work"] += time.perf_counter() - t0
        return run

    for name in ("before_update", "land", "boundary"):
        setattr(ck.pipeline, name, clocked(getattr(ck.pipeline, name)))
    ck._start = clocked(ck._start)
    from tests._support.loops import state
    at_f, handles = {}, []
    ck.plan_checkpoint(3)  # the window: boundaries 2 and 3

    def timed(name, *args, **kw):
        before = ck._job
        charged = before is not None and before.capturing  # a hook inside the window
        this_call["work"] = 0.0
        t0 = time.perf_counter()
        out = getattr(ck, name)(*args, **kw)
        if charged or ck._job is not before:  # ... or the one that starts it
            spent[name] += time.perf_counter() - t0
            work[name] += this_call["work"]
        return out

    for step in range(6):
        loss = model()
        timed("backward_begin")
        loss.backward()
        timed("update_begin")
        opt.step()
        opt.zero_grad()
        h = timed("save_checkpoint", step + 1)
        if h is not None:
            handles.append(h)
        if any(step + 1 == x.final_step for x in handles):
            at_f[step + 1] = state(model, opt)
    ck.close()
    [h] = handles
    assert h.error is None
    fresh, fresh_opt = tiny()
    assert same(at_f[h.final_step], loaded(tmp_path, fresh, fresh_opt)) is None
    manifest = storage.read_manifest(h.path)
    # 2,000 parameters and 4,000 moments in a few packs; the step counters in one column
    assert len(manifest["tensors"]) <= 8
    assert os.path.getsize(os.path.join(h.path, storage.MANIFEST_FILE)) < 1_000_000
    by_hook = gockpt.metrics.read(str(tmp_path))[0]["blocked_by_hook_s"]
    assert work["update_begin"] > 0 and work["save_checkpoint"] > 0  # the hooks did copy
    # (the busy wait is charged under its own name, out of save_checkpoint's count)
    busy = by_hook.get("save_checkpoint_busy_wait", 0.0)
    for name, seconds in spent.items():
        counted = by_hook.get(name, 0.0)
        inner = busy if name == "save_checkpoint" else 0.0
        assert work[name] - inner <= counted <= seconds, (name, by_hook, work, spent)


# ------------------------------------------------------------------ what must stay correct

class Mixed(nn.Module):
    """Views into one storage, a 0-dim and a 0-element parameter, one switched off later."""

    def __init__(self):
        super().__init__()
        base = torch.randn(2 * 24)
        self.a = nn.Parameter(base[:24].view(6, 4))   # two parameters viewing one storage
        self.b = nn.Parameter(base[24:].view(4, 6))
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.empty = nn.Parameter(torch.zeros(0, 3))  # 0 elements
        self.late = nn.Parameter(torch.randn(4))      # requires_grad switched off mid-run

    def forward(self, x):
        return (x @ self.a @ self.b).sum(1) * self.scale + self.empty.sum() + \
            (x[:, :4] * self.late).sum(1)


def mixed():
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40,
                                                cycle_momentum=True)  # changes beta1
    return model, opt, sched


@pytest.mark.parametrize("mode,k", [("gockpt-o", 3), ("gockpt", 2), ("async-o", None)])
def test_what_users_do_today_stays_bitwise(tmp_path, mode, k):
    """Gradient accumulation, bf16 autocast, DataLoader workers (fork), OneCycleLR changing
    betas, views into one storage, 0-dim and 0-element parameters, requires_grad switched off
    mid-run, a directory with spaces behind a symlink -- and a resume with another mode."""
    from tests._support.loops import state
    real = tmp_path / "real dir with spaces"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    directory = str(tmp_path / "link" / "run 1")
    model, opt, sched = mixed()
    ck = gockpt.Checkpointer(model, opt, directory, mode=mode, overlap_steps=k,
                             scheduler=sched, block_bytes=64)
    data = torch.utils.data.DataLoader(torch.randn(64, 6), batch_size=4, num_workers=2)
    at_f, handles = {}, []
    for f in (3 + (k or 1) - 1, 9 + (k or 1) - 1):
        ck.plan_checkpoint(f)
    for step, x in enumerate(data):
        if step == 6:
            model.late.requires_grad_(False)
        ck.backward_begin()
        for micro in x.chunk(2):  # gradient accumulation over two micro-batches
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(micro).float().square().mean()
            loss.backward()
        ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        h = ck.save_checkpoint(step + 1)
        handles += [h] if h else []
        if any(step + 1 == x_.final_step for x_ in handles):
            at_f[step + 1] = dict(state(model, opt), sched=sched.state_dict())
    ck.close()
    assert [h.error for h in handles] == [None, None]
    for h in handles:
        fresh, fresh_opt, fresh_sched = mixed()
        gockpt.load(directory, fresh, fresh_opt, scheduler=fresh_sched, restore_rng=False,
                    tag=storage.checkpoint_name(h.final_step))
        got = dict(state(fresh, fresh_opt), sched=fresh_sched.state_dict())
        assert same(at_f[h.final_step], got) is None, h.final_step
    # resume with another mode and K, and checkpoint again: still the live state
    fresh, fresh_opt, fresh_sched = mixed()
    gockpt.load(directory, fresh, fresh_opt, scheduler=fresh_sched)
    run = Run(fresh, fresh_opt, directory, mode="gockpt-o" if mode != "gockpt-o" else "async",
              overlap_steps=2, step_fn=lambda s: fresh(torch.ones(2, 6) * s).square().mean())
    run.train(handles[-1].final_step, handles[-1].final_step + 4,
              at={handles[-1].final_step + 2})
    run.close()
    assert not run.errors and len(run.committed()) == 1
