"""cpu/deepspeed/FusedAdam: gockpt's replay against DeepSpeed's own CPU Adam op, bit for bit.

The op (DeepSpeed's FusedAdam on the CPU accelerator, JIT-built for this machine) is run on
the same inputs; its SIMD body and its scalar remainder round differently, so sizes around the
vector width are covered, and its float32 running products beta^t are passed as they are.
"""

import numpy as np
import pytest
import torch

from gockpt.replay import arithmetic

pytest.importorskip("deepspeed")  # installed by the README's setup: this never skips in CI

WIDTH = arithmetic.deepspeed_simd_width()


@pytest.fixture(scope="module")
def op():
    import warnings
    warnings.filterwarnings("ignore")
    from deepspeed.ops.adam import FusedAdam
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    return lambda lists, *args: opt.multi_tensor_adam(2048 * 32, opt._dummy_overflow_buf,
                                                      lists, *args)


def inputs(n, seed):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (rng.random(n) * 1e-5).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-40, -3e-39, 1e30, -1e-30, 7.0], np.float32)[:n]
    g[:len(special)] = special  # zeros, subnormals, huge and tiny gradients
    return [torch.from_numpy(x) for x in (p, g, m, v)]


def run_op(op, p, g, m, v, hyper, t, adamw):
    out = [x.clone() for x in (g, p, m, v)]
    op([[out[0]], [out[1]], [out[2]], [out[3]]], hyper["lr"], hyper["betas"][0],
       hyper["betas"][1], hyper["eps"], t, int(adamw), 1, hyper["weight_decay"])
    return out[1], out[2], out[3]


def jump(op, adamw):
    """Make the op forget its running products: the next call computes pow(beta, t)."""
    scratch = [[torch.zeros(1)] for _ in range(4)]
    op(scratch, 1e-3, 0.5, 0.5, 1e-8, 1, int(adamw), 1, 0.0)


def same_bits(a, b):
    a, b = a.view(torch.int32), b.view(torch.int32)
    nan = torch.isnan(a.view(torch.float32)) & torch.isnan(b.view(torch.float32))
    return int(((a != b) & ~nan).sum())


HYPER = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
         dict(lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
         dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)]


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("n", [1, WIDTH - 1 or 1, WIDTH, WIDTH + 3, 4099, 100003])
@pytest.mark.parametrize("h,t", [(0, 2), (1, 6), (2, 123)])
def test_replay_equals_the_op(op, adamw, n, h, t):
    hyper = HYPER[h]
    p, g, m, v = inputs(n, seed=n + t)
    jump(op, adamw)
    want = run_op(op, p, g, m, v, hyper, t, adamw)
    got = [x.clone() for x in (p, m, v)]
    arithmetic.replay_step(f"cpu/deepspeed/FusedAdam/adam_w_mode={adamw}", got[0], got[1],
                           got[2], g, step=t, **hyper)
    assert [same_bits(a, b) for a, b in zip(got, want)] == [0, 0, 0]


def test_the_running_products_are_replayed_as_the_op_keeps_them(op):
    # Steps 1..18 in a row, then step 19: the op multiplies its float32 products, which from
    # t = 19 differ from pow(0.999, t) -- so does the update.
    hyper, t = HYPER[0], 19
    p, g, m, v = inputs(4099, seed=1)
    jump(op, True)
    for step in range(1, t):
        run_op(op, p, g, m, v, hyper, step, True)
    want = run_op(op, p, g, m, v, hyper, t, True)
    b1 = b2 = np.float32(1)
    for _ in range(t):
        b1, b2 = np.float32(b1 * np.float32(0.9)), np.float32(b2 * np.float32(0.999))
    arith = "cpu/deepspeed/FusedAdam/adam_w_mode=True"
    chained = [x.clone() for x in (p, m, v)]
    arithmetic.replay_step(arith, *chained, g, step=t, beta_powers=(b1, b2), **hyper)
    assert [same_bits(a, b) for a, b in zip(chained, want)] == [0, 0, 0]
    powered = [x.clone() for x in (p, m, v)]
    arithmetic.replay_step(arith, *powered, g, step=t, **hyper)
    assert same_bits(powered[0], want[0]) > 0  # pow is not what the op used


@pytest.mark.skipif(WIDTH == 1, reason="no SIMD build of the op on this CPU")
def test_the_scalar_tail_is_where_the_op_has_it(op):
    n = 4 * WIDTH + WIDTH // 2  # a tail of WIDTH/2 elements
    p, g, m, v = inputs(n, seed=3)
    jump(op, True)
    want = run_op(op, p, g, m, v, HYPER[1], 6, True)
    for width, exact in ((WIDTH, True), (1, False)):
        got = [x.clone() for x in (p, m, v)]
        arithmetic.replay_step("cpu/deepspeed/FusedAdam/adam_w_mode=True", *got, g, step=6,
                               simd_width=width, **HYPER[1])
        assert (sum(same_bits(a, b) for a, b in zip(got, want)) == 0) == exact, width


def test_slices_replay_like_the_whole_tensor():
    n, t = 10007, 7
    p, g, m, v = inputs(n, seed=5)
    whole = [x.clone() for x in (p, m, v)]
    hyper = HYPER[0]
    arithmetic.replay_step("cpu/deepspeed/FusedAdam/adam_w_mode=True", *whole, g, step=t,
                           **hyper)
    parts = [x.clone() for x in (p, m, v)]
    cuts = [0, 5, 1000, 9999, n]  # odd offsets; the last slice holds the scalar tail
    addr = lambda t, i: t.data_ptr() + 4 * i  # noqa: E731
    arithmetic.replay_batch(
        [addr(parts[0], a) for a in cuts[:-1]], [addr(parts[1], a) for a in cuts[:-1]],
        [addr(parts[2], a) for a in cuts[:-1]], [addr(g, a) for a in cuts[:-1]],
        np.diff(cuts), cuts[:-1], [n] * 4, [0] * 4, [f"deepspeed-cpu-w{WIDTH}"], [True],
        [hyper["lr"]], [hyper["betas"][0]], [hyper["betas"][1]], [hyper["eps"]],
        [hyper["weight_decay"]], [t], threads=2)
    assert [same_bits(a, b) for a, b in zip(parts, whole)] == [0, 0, 0]


def test_deepspeed_only_options_are_refused_elsewhere():
    p, g, m, v = inputs(8, seed=0)
    with pytest.raises(ValueError, match="DeepSpeed"):
        arithmetic.replay_step("cpu/torch/AdamW/fused", p, m, v, g, step=1, beta_powers=(0.9, 0.9),
                               **HYPER[0])
    with pytest.raises(ValueError, match="simd_width"):
        arithmetic.replay_step("cpu/deepspeed/FusedAdam/adam_w_mode=True", p, m, v, g, step=1,
                               simd_width=4, **HYPER[0])
    assert "cpu/deepspeed/FusedAdam/adam_w_mode=True" in arithmetic.replay_arithmetics()
