import pytest
import torch

from gockpt.core.errors import UnsupportedOptimizerError
from gockpt.replay.adapters import adapter_for


def opt_of(cls=torch.optim.AdamW, **kw):
    return cls(torch.nn.Linear(3, 3).parameters(), **kw)


@pytest.mark.parametrize("kw,impl", [({}, "single"), ({"foreach": True}, "foreach"),
                                     ({"fused": True}, "fused")])
def test_scalars_name_the_implementation(kw, impl):
    opt = opt_of(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, **kw)
    sc = adapter_for(opt).scalars()[0]
    assert (sc.lr, sc.beta1, sc.beta2, sc.eps, sc.weight_decay) == (0.01, 0.8, 0.9, 1e-6, 0.2)
    assert sc.impl == impl and sc.decoupled
    assert not adapter_for(opt_of(torch.optim.Adam, **kw)).scalars()[0].decoupled


def test_step_count_follows_state():
    opt = opt_of()
    ad = adapter_for(opt)
    p = opt.param_groups[0]["params"][0]
    assert ad.step_count(p) == 1.0
    p.grad = torch.ones_like(p)
    opt.step(); opt.step()
    assert ad.step_count(p) == 3.0


@pytest.mark.parametrize("make", [
    lambda: opt_of(torch.optim.SGD, lr=0.1), lambda: opt_of(amsgrad=True),
    lambda: opt_of(maximize=True), lambda: opt_of(capturable=True),
    lambda: torch.optim.AdamW(torch.nn.Linear(2, 2).double().parameters())])
def test_refusals(make):
    with pytest.raises(UnsupportedOptimizerError, match="async-o"):
        adapter_for(make())
