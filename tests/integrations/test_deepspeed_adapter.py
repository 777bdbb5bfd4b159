"""gockpt.integrations.deepspeed.adapter: DeepSpeed's CPU FusedAdam, its op's running products."""

import numpy as np
import pytest
import torch

from gockpt.core.errors import UnsupportedOptimizerError
from gockpt.replay.adapters import adapter_for
from gockpt.integrations.deepspeed.adapter import DeepSpeedCpuAdamAdapter, _chain, _OpMirror

pytest.importorskip("deepspeed")  # installed by the README's setup: this never skips in CI


def fused_adam(**kw):
    import warnings
    warnings.filterwarnings("ignore")
    from deepspeed.ops.adam import FusedAdam
    p = torch.nn.Parameter(torch.randn(100))
    return p, FusedAdam([p], lr=1e-3, betas=(0.9, 0.999), **kw)


def train(p, opt, steps):
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        opt.step()


def test_the_mirror_follows_increment_step():
    m = _OpMirror()
    first = m.increment(1, 0.9, 0.999)           # placeholders -> pow
    assert first == (float(np.float32(0.9)), float(np.float32(0.999)))
    assert m.increment(1, 0.9, 0.999) == first   # same step: unchanged
    second = m.increment(2, 0.9, 0.999)          # next step: product
    assert second == (float(np.float32(np.float32(0.9) * np.float32(0.9))),
                      float(np.float32(np.float32(0.999) * np.float32(0.999))))
    jumped = m.increment(19, 0.9, 0.999)         # a jump: pow
    assert jumped == (float(np.float32(float(np.float32(0.9)) ** 19)),
                      float(np.float32(float(np.float32(0.999)) ** 19)))
    assert jumped != _chain((0.9, 0.999), 19)    # from t = 19 the product differs


def test_the_probe_reads_the_ops_products_without_changing_them():
    p, opt = fused_adam()
    train(p, opt, 19)
    adapter = adapter_for(opt)
    assert isinstance(adapter, DeepSpeedCpuAdamAdapter)
    assert tuple(map(float, adapter.mirror.powers)) == _chain((0.9, 0.999), 19)
    # The op still has its product: the next real step uses it, and the mirror agrees.
    p.grad = torch.randn_like(p)
    opt.step()
    assert adapter.current[0] == _chain((0.9, 0.999), 20)
    adapter.close()


def test_refused_where_the_replay_is_not_exact():
    _, opt = fused_adam(bias_correction=False)
    with pytest.raises(UnsupportedOptimizerError, match="bias_correction"):
        adapter_for(opt)


def _next_update_is_replayed_bitwise(p, opt, adapter):
    """The real next step against the replay of it with the adapter's beta powers."""
    from gockpt.replay import arithmetic
    st = opt.state[p]
    want = [p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
    p.grad = torch.randn_like(p)
    g = p.grad.clone()
    opt.step()
    group = opt.param_groups[0]
    arithmetic.replay_step("cpu/deepspeed/FusedAdam/adam_w_mode=True", *want, g,
                           lr=group["lr"], betas=group["betas"], eps=group["eps"],
                           weight_decay=group["weight_decay"], step=int(st["step"]),
                           beta_powers=adapter.current[0], simd_width=adapter.width)
    return all(torch.equal(a, b) for a, b in zip(want, [p.detach(), st["exp_avg"],
                                                         st["exp_avg_sq"]]))


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.98), (0.9, 0.99), (0.9, 0.999)])
@pytest.mark.parametrize("steps", [6, 12, 30, 200])
def test_the_probe_reads_the_products_of_the_betas_llms_use(betas, steps):
    # Parameters near 1 and lr 1e-3 hid one ulp of a bias correction: with betas below 0.999
    # both candidates matched and the op's state was refused as unknown.
    torch.manual_seed(0)
    p, opt = fused_adam()
    opt.param_groups[0]["betas"] = betas
    train(p, opt, steps)
    adapter = adapter_for(opt)
    assert adapter.unsupported_step() is None
    assert tuple(map(float, adapter.mirror.powers)) == _chain(betas, steps)
    assert _next_update_is_replayed_bitwise(p, opt, adapter)
    adapter.close()


@pytest.mark.parametrize("first", [1000, 5000])
def test_a_process_that_resumed_natively_is_read_too(first):
    # DeepSpeed's own resume: the fresh process's first step jumps to t, the op takes pow(beta,
    # t) there and the running product from then on.
    torch.manual_seed(0)
    p, opt = fused_adam()
    train(p, opt, 1)
    opt.state[p]["step"] = first - 1
    train(p, opt, 25)
    adapter = adapter_for(opt)
    assert adapter.unsupported_step() is None
    for _ in range(3):  # the mirror keeps following the op
        assert _next_update_is_replayed_bitwise(p, opt, adapter)
    adapter.close()


def test_an_op_state_that_cannot_be_read_is_not_replayed_and_read_again_later(monkeypatch):
    # Not a refusal at construction (a DeepSpeed engine builds its Checkpointer at the first
    # save, in the middle of training): the steps are reported as not replayable (the
    # checkpoint is then copied at its step), and the op is read again before the next step.
    import gockpt.integrations.deepspeed.adapter as da
    torch.manual_seed(0)
    p, opt = fused_adam()
    train(p, opt, 7)
    real = da._probe_powers
    monkeypatch.setattr(da, "_probe_powers", lambda *a, **k: None)
    adapter = adapter_for(opt)
    assert adapter.mirror is None
    assert "neither the running product" in adapter.unsupported_step()
    monkeypatch.setattr(da, "_probe_powers", real)
    assert _next_update_is_replayed_bitwise(p, opt, adapter)  # read before that step
    assert adapter.unsupported_step() is None
    adapter.close()


def test_training_goes_on_and_each_checkpoint_is_copied_at_its_step(tmp_path, monkeypatch):
    # A custom loop on DeepSpeed's FusedAdam in gockpt-o whose op cannot be read: the window
    # is refused with a warning, the checkpoint is copied at its step (K = 1), training
    # goes on, and every checkpoint is its step's state.
    import warnings
    import gockpt
    import gockpt.integrations.deepspeed.adapter as da
    from gockpt import testing
    monkeypatch.setattr(da, "_probe_powers", lambda *a, **k: None)
    torch.manual_seed(0)
    p, opt = fused_adam()
    opt.param_groups[0]["betas"] = (0.9, 0.95)
    train(p, opt, 5)  # the op has stepped before the Checkpointer exists
    model = torch.nn.ParameterList([p])
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             block_bytes=128, interval=4)
    live = {}
    with pytest.warns(UserWarning, match="the replay cannot follow .*neither the running"):
        for step in range(5, 14):
            ck.backward_begin()
            p.grad = torch.randn_like(p)
            ck.update_begin()
            opt.step()
            ck.save_checkpoint(step + 1)
            snap = testing.snapshot(model, opt)
            live[step + 1] = (snap["model"], snap["optimizer"])
        ck.close()
    records = gockpt.metrics.read(str(tmp_path))
    assert [(m["final_step"], m["overlap_steps"]) for m in records] == [(8, 1), (12, 1)]
    for step in (8, 12):
        q = torch.nn.Parameter(torch.zeros(100))
        from deepspeed.ops.adam import FusedAdam
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = FusedAdam([q], lr=1e-3, betas=(0.9, 0.95))
        fresh = torch.nn.ParameterList([q])
        gockpt.load(str(tmp_path), fresh, o, tag=f"step-{step:09d}", restore_rng=False)
        snap = testing.snapshot(fresh, o)
        assert testing.first_difference(live[step], (snap["model"], snap["optimizer"])) is None


def test_the_cuda_adapter_takes_cuda_float32_parameters_only():
    """DeepSpeed's FusedAdam on CUDA gets the moments-only adapter (its parameters copied at
    F); handed CPU parameters it refuses, naming their device. (On a GPU:
    tests/gpu/test_gpu_deepspeed.py.)"""
    from gockpt.integrations.deepspeed.adapter import DeepSpeedCudaAdamAdapter, fused_adam_adapter
    _, opt = fused_adam()
    said = []

    def refuse(optimizer, why):
        said.append(why)
        raise UnsupportedOptimizerError(why)
    with pytest.raises(UnsupportedOptimizerError):
        DeepSpeedCudaAdamAdapter(opt, refuse)
    assert "on cpu" in said[0] and "float32" in said[0]
    assert isinstance(fused_adam_adapter(opt, refuse), DeepSpeedCpuAdamAdapter)
    assert fused_adam_adapter.state_keys == ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_cuda_moments_probe_runs_a_fresh_fused_adam_and_sees_another_arithmetic(adam_w_mode):
    """The attach-time probe of the CUDA adapter builds a fresh FusedAdam with the group's
    settings and compares its moments with the deepspeed-cuda-moments replay. Here (no GPU)
    FusedAdam runs its CPU op, whose moments are contracted otherwise: the probe must say so."""
    import warnings
    warnings.filterwarnings("ignore")
    from deepspeed.ops.adam import FusedAdam
    from gockpt.core.records import GroupScalars, Kernel
    from gockpt.replay import probe as probe_mod
    sc = GroupScalars(1e-3, 0.9, 0.999, 1e-8, 0.01 if adam_w_mode else 0.0,
                      Kernel.DEEPSPEED_CUDA_MOMENTS, adam_w_mode)
    assert probe_mod.probe(FusedAdam, sc, moments_only=True) is False
