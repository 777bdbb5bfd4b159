"""gockpt.replay.selfcheck: a sample of replayed blocks is copied directly at F and compared
with the replay's result."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from gockpt.capture.device import HostDevice
from gockpt.core.memory import flat
from gockpt.core.planning import build_plan
from gockpt.core.staging import HostCopy
from gockpt.core.errors import ConsistencyError
from gockpt.core.job import Job
from gockpt.replay import selfcheck

KEYS = ("exp_avg", "exp_avg_sq")


@pytest.fixture
def rig():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    plan = build_plan(model, opt, 64)  # 16 elements per block
    host = HostCopy(plan, HostDevice())
    host.set_keys({si: {k: s.param for k in KEYS} for si, s in enumerate(plan.slots)})
    for si, s in enumerate(plan.slots):
        # the host copy holds exactly the live state: what a correct replay produces
        host.param[si].copy_(flat(s.param))
        for k in KEYS:
            host.state[si][k].copy_(flat(opt.state[s.param][k]))
    return SimpleNamespace(model=model, opt=opt, plan=plan, host=host)


def job_at(rig, f_boundary, captured):
    k = 3
    job = Job(f_boundary - k + 1, k, f_boundary - k + 1, rig.plan.groups(k), "gockpt", "x",
              host=rig.host, plan=rig.plan)
    job.capture.captured = list(captured)
    return job


def picks(job):
    return [b for b, _ in job.samples]


@pytest.mark.parametrize("fraction,expected", [(0.25, 5), (0.01, 1), (1.0, 20)])
def test_sample_picks_a_fraction_of_the_replayed_blocks(rig, fraction, expected):
    captured = rig.plan.blocks[:20]
    assert len(rig.plan.blocks) > 20  # some blocks are not replayed (captured at F)
    job = job_at(rig, 9, captured)
    selfcheck.sample(job, rig.plan, rig.opt, fraction)
    got = picks(job)
    assert len(got) == expected == len(set(got))
    assert set(got) <= set(captured)


def test_sample_is_deterministic_per_boundary(rig):
    captured = rig.plan.blocks[:20]
    by_boundary = {}
    for f in (5, 6, 7, 8, 9):
        a, b = job_at(rig, f, captured), job_at(rig, f, captured)
        selfcheck.sample(a, rig.plan, rig.opt, 0.2)
        selfcheck.sample(b, rig.plan, rig.opt, 0.2)
        assert picks(a) == picks(b)
        by_boundary[f] = tuple(picks(a))
    assert len(set(by_boundary.values())) > 1  # other boundaries check other blocks


def test_sample_nothing_without_replayed_blocks_or_with_fraction_zero(rig):
    job = job_at(rig, 5, [])
    selfcheck.sample(job, rig.plan, rig.opt, 1.0)
    assert job.samples == []
    job = job_at(rig, 5, rig.plan.blocks)
    selfcheck.sample(job, rig.plan, rig.opt, 0.0)
    assert job.samples == []


def test_samples_are_copies_of_the_live_state_at_F(rig):
    job = job_at(rig, 5, rig.plan.blocks)
    selfcheck.sample(job, rig.plan, rig.opt, 1.0)
    b, direct = job.samples[0]
    slot = rig.plan.slots[b.slot]
    assert set(direct) == {"param", *KEYS}
    before = direct["param"].clone()
    assert torch.equal(before, flat(slot.param)[b.start:b.end])
    assert torch.equal(direct["exp_avg"], flat(rig.opt.state[slot.param]["exp_avg"])[b.start:b.end])
    with torch.no_grad():
        slot.param.add_(1.0)  # training moves on after F
    assert torch.equal(direct["param"], before)


def test_verify_passes_on_equal_data_and_records_metrics(rig):
    job = job_at(rig, 5, rig.plan.blocks)
    selfcheck.sample(job, rig.plan, rig.opt, 0.5)
    n = len(job.samples)
    selfcheck.verify(job, rig.plan, strict=True)
    assert job.metrics.self_check_blocks == n > 0
    assert job.metrics.self_check_mismatches == 0
    assert job.samples == []


@pytest.mark.parametrize("tensor", ["param", "exp_avg_sq"])
def test_verify_strict_names_tensor_and_range(rig, tensor):
    job = job_at(rig, 5, rig.plan.blocks)
    selfcheck.sample(job, rig.plan, rig.opt, 1.0)
    b = rig.plan.blocks[3]
    buf = rig.host.param[b.slot] if tensor == "param" else rig.host.state[b.slot][tensor]
    buf[b.start + 1] += 1e-3  # a replay that is off by one rounding somewhere
    name = rig.plan.slots[b.slot].name
    with pytest.raises(ConsistencyError,
                       match=re.escape(f"{name}[{b.start}:{b.end}] ({tensor})") + ".*not committed"):
        selfcheck.verify(job, rig.plan, strict=True)
    assert job.metrics.self_check_mismatches == 1
    assert job.metrics.self_check_blocks == len(rig.plan.blocks)


def test_verify_not_strict_warns(rig):
    job = job_at(rig, 5, rig.plan.blocks)
    selfcheck.sample(job, rig.plan, rig.opt, 1.0)
    b = rig.plan.blocks[0]
    rig.host.state[b.slot]["exp_avg"][b.start] += 1.0
    with pytest.warns(UserWarning, match="self-check: 1 replayed block"):
        selfcheck.verify(job, rig.plan, strict=False)
    assert job.metrics.self_check_mismatches == 1


def test_verify_without_samples_is_silent(rig):
    job = job_at(rig, 5, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selfcheck.verify(job, rig.plan, strict=False)
    assert job.metrics.self_check_blocks == 0
