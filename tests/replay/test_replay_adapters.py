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


def test_scalars_follow_every_change_of_a_param_group():
    # read again after any change of a group's dict; never kept where a value read may
    # change in place (a list of betas, a tensor lr): each read checked against the group now
    opt = opt_of(lr=0.01)
    ad = adapter_for(opt)
    g = opt.param_groups[0]

    def lr_b1():
        sc = ad.scalars()[0]
        return sc.lr, sc.beta1

    assert lr_b1() == lr_b1() == (0.01, 0.9)
    g["lr"] = 0.5  # (a scheduler's step)
    assert lr_b1() == (0.5, 0.9)
    g["betas"] = [0.5, 0.999]
    assert lr_b1() == (0.5, 0.5)
    g["betas"][0] = 0.7  # the same dict, its list changed in place
    assert lr_b1() == (0.5, 0.7)
    g["betas"] = (0.6, 0.999)
    g["lr"] = torch.tensor(0.25, dtype=torch.float64)
    assert lr_b1() == (0.25, 0.6)
    g["lr"].fill_(0.125)
    assert lr_b1() == (0.125, 0.6)
    g["lr"] = 0.0625
    assert lr_b1() == lr_b1() == (0.0625, 0.6)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 2.0})
    assert [sc.lr for sc in ad.scalars().values()] == [0.0625, 2.0]


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
