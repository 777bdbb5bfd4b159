"""gockpt.replay.deepspeed_adapter: DeepSpeed's CPU FusedAdam, its op's running products."""

import numpy as np
import pytest
import torch

from gockpt.errors import UnsupportedOptimizerError
from gockpt.replay.adapters import adapter_for
from gockpt.replay.deepspeed_adapter import DeepSpeedCpuAdamAdapter, _chain, _OpMirror

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
