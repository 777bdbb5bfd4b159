"""gockpt.replay.probe: a few real optimizer steps are replayed at attach time; any difference
refuses the replay modes at construction instead of at F."""

from __future__ import annotations

import pytest
import torch

from gockpt.core.errors import UnsupportedOptimizerError
from gockpt.replay import arithmetic, probe as probe_mod
from gockpt.replay.adapters import adapter_for
from gockpt.core.records import GroupScalars


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty probe cache for this test (restored afterwards, so no verdict leaks out)."""
    monkeypatch.setattr(probe_mod, "_PROBED", {})
    return probe_mod._PROBED


def scalars(impl="single", decoupled=True, **kw):
    base = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    base.update(kw)
    return GroupScalars(impl=impl, decoupled=decoupled, **base)


@pytest.mark.parametrize("cls,decoupled", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_probe_passes_for_supported_settings(fresh_cache, cls, decoupled, impl):
    assert probe_mod.probe(cls, scalars(impl, decoupled, lr=3e-2, weight_decay=0.2))


def test_probe_caches_by_value(fresh_cache, monkeypatch):
    calls = []
    real = arithmetic.adam_replay
    monkeypatch.setattr(arithmetic, "adam_replay", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert probe_mod.probe(torch.optim.AdamW, scalars())
    n = len(calls)
    assert n == 3  # three probe steps
    assert probe_mod.probe(torch.optim.AdamW, scalars())  # an equal GroupScalars: cached
    assert len(calls) == n
    assert probe_mod.probe(torch.optim.AdamW, scalars(lr=2e-3))  # other settings: probed
    assert len(calls) == 2 * n


def off_by_one_ulp(monkeypatch):
    real = arithmetic.adam_replay

    def wrong(param, *args, **kw):
        real(param, *args, **kw)
        param[0] = torch.nextafter(param[0], torch.tensor(float("inf")))
    monkeypatch.setattr(arithmetic, "adam_replay", wrong)


def test_a_wrong_kernel_makes_the_probe_fail(fresh_cache, monkeypatch):
    off_by_one_ulp(monkeypatch)
    assert probe_mod.probe(torch.optim.AdamW, scalars()) is False


def test_a_wrong_kernel_makes_the_adapter_refuse(fresh_cache, monkeypatch):
    off_by_one_ulp(monkeypatch)
    opt = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters(), lr=0.01)
    with pytest.raises(UnsupportedOptimizerError, match="probe replay of param group 0"):
        adapter_for(opt)


@pytest.mark.parametrize("cls,decoupled", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
@pytest.mark.parametrize("impl", ["single", "fused"])
def test_a_moments_only_probe_compares_the_moments_alone(fresh_cache, monkeypatch, cls,
                                                         decoupled, impl):
    """moments_only: a parameter line off by one ulp is not looked at (that parameter is copied
    at F), a moment off by one ulp is found, each step reads the real parameter."""
    sc = scalars(impl, decoupled, lr=3e-2, weight_decay=0.2)
    assert probe_mod.probe(cls, sc, moments_only=True)
    off_by_one_ulp(monkeypatch)  # the replayed parameter wrong: not compared
    assert probe_mod.probe(cls, scalars(impl, decoupled, lr=2e-2), moments_only=True)
    real = arithmetic.adam_replay

    def wrong_moment(param, exp_avg, *args, **kw):
        real(param, exp_avg, *args, **kw)
        exp_avg[5] = torch.nextafter(exp_avg[5], torch.tensor(float("inf")))
    monkeypatch.setattr(arithmetic, "adam_replay", wrong_moment)
    assert probe_mod.probe(cls, scalars(impl, decoupled, lr=1e-2), moments_only=True) is False


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo process group and its CPU device mesh (torch.distributed.tensor needs
    one to place a DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dim", [0, 1])
def test_the_probe_steps_dtensors_placed_like_the_parameters(fresh_cache, monkeypatch,
                                                             one_rank_mesh, dim):
    """FSDP2's Shard(0) and a row-parallel Shard(1) weight: the probe steps 1-D DTensors on
    the same mesh (a sharded dimension moved to 0), and a wrong kernel still fails it."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), one_rank_mesh, [Shard(dim)]))
    stepped = []
    real = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **kw: stepped.append(
        all(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]))
        or real(self, *a, **kw))
    assert probe_mod.probe(torch.optim.AdamW, scalars(), like=w)
    assert stepped == [True] * 3
    adapter_for(torch.optim.AdamW([w], lr=1e-3))  # the adapter's probe accepts it too
    off_by_one_ulp(monkeypatch)
    assert probe_mod.probe(torch.optim.AdamW, scalars(lr=2e-3), like=w) is False
