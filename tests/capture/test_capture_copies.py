"""gockpt.capture.copies: what the hooks copy into a job's host copy, and when they refuse."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from gockpt.capture.copies import Capture
from gockpt.capture.gradients import live_gradients as _live_gradients
from gockpt.capture.device import HostDevice
from gockpt.core.memory import flat
from gockpt.core.planning import build_plan, stepped_groups
from gockpt.core.staging import GradPool, HostCopy
from gockpt.capture.transfer import CopyEngine
from gockpt.core.errors import ConfigError, HookOrderError
from gockpt.core.job import Job, State
from gockpt.replay.adapters import adapter_for
from gockpt.core.optstate import expand_columns
from gockpt.pipeline import freeze_small_state
from gockpt.storage.schema import SmallSection

from tests._support import harness as H


def make_rig(optimizer="adamw", replay=True):
    H.seed_all(0)
    if optimizer == "sgd":
        model = H.Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = None
    else:
        model, opt, sched = H.build(optim=optimizer)
    plan = build_plan(model, opt, 256)  # 64 elements per block
    engine = CopyEngine(HostDevice())
    adapter = adapter_for(opt) if replay else None
    capture = Capture(model, opt, sched, engine, adapter)
    host = HostCopy(plan, HostDevice())
    return SimpleNamespace(model=model, opt=opt, sched=sched, plan=plan, engine=engine,
                           adapter=adapter, capture=capture, host=host)


@pytest.fixture
def rig():
    r = make_rig()
    yield r
    r.engine.close()


def new_job(rig, k):
    rig.capture.declare_state_keys(rig.host)
    return Job(5, k, 5, rig.plan.groups(k), "gockpt", "unused", host=rig.host, plan=rig.plan)


def every_group(rig):
    """The planned index of every param group (an ordinary optimizer.step())."""
    return tuple(range(len(rig.opt.param_groups)))


def slot_index(rig, name):
    return next(i for i, s in enumerate(rig.plan.slots) if s.name == name)


def fill_host(host, value):
    for t in host.param:
        t.fill_(value)
    for st in host.state:
        for t in st.values():
            t.fill_(value)


def one_backward(rig, step):
    """A forward/backward of the harness's step ``step`` (odd steps give aux a gradient)."""
    x, y = H.batch(step)
    rig.opt.zero_grad()
    torch.nn.functional.cross_entropy(rig.model(x, step), y).backward()


def optimizer_step(rig):
    """One training step (odd: every trainable parameter gets a gradient, hence state)."""
    one_backward(rig, 1)
    rig.opt.step()
    if rig.sched is not None:
        rig.sched.step()


# ------------------------------------------------------------------ declare_state_keys

def test_declare_state_keys_with_an_adapter_names_the_replayed_state(rig):
    rig.capture.declare_state_keys(rig.host)
    for si, s in enumerate(rig.plan.slots):
        if s.static:
            assert rig.host.keys[si] == () and rig.host.state[si] == {}
        else:
            assert rig.host.keys[si] == ("exp_avg", "exp_avg_sq")
            assert all(rig.host.state[si][k].numel() == s.numel for k in rig.host.keys[si])
    assert any(s.static for s in rig.plan.slots)  # frozen.bias: outside the optimizer


def test_declare_state_keys_without_an_adapter_takes_the_live_aligned_tensors():
    r = make_rig("sgd", replay=False)
    try:
        optimizer_step(r)
        r.capture.declare_state_keys(r.host)
        for si, s in enumerate(r.plan.slots):
            expected = ("momentum_buffer",) if s.param in r.opt.state else ()
            assert r.host.keys[si] == expected, s.name
        assert r.host.keys[slot_index(r, "inp.weight")] == ("momentum_buffer",)
        assert r.host.keys[slot_index(r, "frozen.weight")] == ()  # never had a gradient
    finally:
        r.engine.close()


# ------------------------------------------------------------------ state groups

@pytest.mark.parametrize("j", [2, 3])
def test_enqueue_group_copies_exactly_its_ranges_and_zero_fills_missing_state(rig, j):
    optimizer_step(rig)  # every trained param has state now
    job = new_job(rig, 3)
    fill_host(rig.host, float("nan"))
    rig.capture.enqueue_group(job, j)
    job.capture.tickets[j].wait()
    group = set(job.capture.groups[j - 1])
    assert group and len(group) < len(rig.plan.blocks)
    frozen_w = slot_index(rig, "frozen.weight")  # optimized, never a gradient: no state
    assert rig.opt.param_groups[2]["params"][0] is rig.plan.slots[frozen_w].param
    zero_filled = set()
    for b in rig.plan.blocks:
        s, e = b.start, b.end
        slot = rig.plan.slots[b.slot]
        host_param = rig.host.param[b.slot][s:e]
        if b not in group:
            assert torch.isnan(host_param).all(), f"{slot.name}[{s}:{e}] was copied"
            for key in rig.host.keys[b.slot]:
                assert torch.isnan(rig.host.state[b.slot][key][s:e]).all()
            continue
        assert torch.equal(host_param, flat(slot.param)[s:e]), f"{slot.name}[{s}:{e}]"
        live = rig.opt.state.get(slot.param, {})
        for key in rig.host.keys[b.slot]:
            got = rig.host.state[b.slot][key][s:e]
            if key in live:
                assert torch.equal(got, flat(live[key])[s:e]), f"{slot.name}.{key}[{s}:{e}]"
            else:
                zero_filled.add(slot.name)
                assert torch.equal(got, torch.zeros_like(got)), f"{slot.name}.{key}[{s}:{e}]"
    # group 3 holds frozen.weight (no state: zero-filled); the static frozen.bias is in no
    # group: it is copied directly at F
    assert zero_filled == ({"frozen.weight"} if j == 3 else set())
    assert not any(rig.plan.slots[b.slot].static for b in group)


def test_copy_at_f_copies_the_static_slots_now(rig):
    optimizer_step(rig)
    job = new_job(rig, 3)
    fill_host(rig.host, float("nan"))
    blocks = rig.capture.copy_at_f(job)
    frozen_b = slot_index(rig, "frozen.bias")
    assert blocks and {b.slot for b in blocks} == {frozen_b}
    assert torch.equal(rig.host.param[frozen_b], flat(rig.plan.slots[frozen_b].param))
    assert job.capture.captured == blocks
    assert all(b not in g for g in job.capture.groups for b in blocks)


def test_missing_state_is_zeroed_before_the_first_step(rig):
    job = new_job(rig, 1)
    fill_host(rig.host, 7.0)
    rig.capture.enqueue_group(job, 1)
    job.capture.tickets[1].wait()
    for si, s in enumerate(rig.plan.slots):
        if s.at_f:
            continue  # copied at the boundary of F, not in a group
        assert torch.equal(rig.host.param[si], flat(s.param))
        for key in rig.host.keys[si]:
            assert not rig.host.state[si][key].any(), f"{s.name}.{key} not zeroed"


def test_land_group_records_captured_blocks_in_order(rig):
    job = new_job(rig, 3)
    rig.capture.land_group(job, 1)  # nothing queued: nothing landed
    assert job.capture.captured == []
    for j in (1, 2):
        rig.capture.enqueue_group(job, j)
        rig.capture.land_group(job, j)
        assert job.capture.tickets[j].done()
    assert job.capture.captured == job.capture.groups[0] + job.capture.groups[1]
    assert job.state is State.CAPTURING


def test_copy_rest_copies_every_remaining_group_and_marks_captured(rig):
    optimizer_step(rig)
    job = new_job(rig, 3)
    fill_host(rig.host, float("nan"))
    rig.capture.enqueue_group(job, 1)
    first = job.capture.tickets[1]
    rig.capture.copy_rest(job)
    assert job.capture.tickets[1] is first  # group 1 was not queued twice
    assert sorted(job.capture.tickets) == [1, 2, 3]
    assert job.capture.captured == [b for b in rig.plan.blocks if not rig.plan.slots[b.slot].at_f]
    assert job.state is State.CAPTURED
    for si, s in enumerate(rig.plan.slots):
        assert s.at_f or torch.equal(rig.host.param[si], flat(s.param)), s.name


# ------------------------------------------------------------------ small state

def test_small_state_encodes_plain_json_and_tensors(rig):
    optimizer_step(rig)
    job = new_job(rig, 2)
    called = []

    def extra():
        called.append(True)
        return {"t": torch.arange(3.0), "pair": (1, "a"), "raw": b"\x00\xff", "inf": float("inf")}

    freeze_small_state(rig.capture, job, 6, extra)
    small, tensors = job.small, job.small_tensors
    assert called == [True]  # the callable was called at the boundary of F
    assert isinstance(small, SmallSection)
    json.dumps(asdict(small), allow_nan=False)  # plain JSON: nothing pickled
    assert tensors and all(k.startswith("small/") for k in tensors)
    H.assert_same(small.decode("extra_state", tensors),
                  {"t": torch.arange(3.0), "pair": (1, "a"), "raw": b"\x00\xff",
                   "inf": float("inf")})
    buffers = small.decode("model", tensors)
    assert set(buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert torch.equal(buffers["bn.running_mean"], rig.model.bn.running_mean)
    # aligned: every optimizer state index that has state, with the keys stored as tensors
    in_state = {s.opt_index for s in rig.plan.slots if not s.static and s.param in rig.opt.state}
    assert job.aligned == {i: ("exp_avg", "exp_avg_sq") for i in in_state}
    assert slot_index(rig, "frozen.weight") not in in_state
    opt_small = small.decode("optimizer", tensors)
    for idx, st in expand_columns(opt_small).items():
        assert set(st) == {"step"}, idx  # aligned tensors travel as blocks
    assert opt_small["param_groups"] == rig.opt.state_dict()["param_groups"]
    assert small.decode("scheduler", tensors) == rig.sched.state_dict()


def test_small_state_refuses_extra_state_that_needs_pickle(rig):
    job = new_job(rig, 1)
    with pytest.raises(ConfigError, match=r"step 4.*extra_state\['fn'\].*without pickle"):
        freeze_small_state(rig.capture, job, 4, {"fn": object()})
    assert job.small is None and job.small_tensors == {}


def test_small_state_refuses_self_containing_extra_state_as_a_config_error(rig):
    job = new_job(rig, 1)
    loop = {}
    loop["me"] = loop
    with pytest.raises(ConfigError, match="contains itself"):
        freeze_small_state(rig.capture, job, 4, loop)


# ------------------------------------------------------------------ gradients

class CountingPool(GradPool):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.acquired = 0

    def acquire(self):
        self.acquired += 1
        return super().acquire()


def test_gradients_records_only_captured_blocks_whose_param_has_a_grad(rig):
    optimizer_step(rig)
    job = new_job(rig, 3)
    for j in (1, 2):
        rig.capture.enqueue_group(job, j)
        rig.capture.land_group(job, j)
    one_backward(rig, 2)  # even step: aux gets no gradient; frozen never does
    pool = CountingPool(rig.plan, HostDevice())
    record = rig.capture.gradients(job, 1, every_group(rig), pool)
    record.ticket.wait()
    with_grad = {si for si, s in enumerate(rig.plan.slots)
                 if not s.static and s.param.grad is not None}
    expected = [b for b in job.capture.captured if b.slot in with_grad]
    assert record.blocks == expected
    # the test means something: some captured blocks lack a gradient, some blocks are not captured
    assert len(expected) < len(job.capture.captured) < len(rig.plan.blocks)
    for b in record.blocks:
        g = rig.plan.slots[b.slot].param.grad
        assert torch.equal(record.grads[b.slot][b.start:b.end], flat(g)[b.start:b.end])
    replayed = {b.slot for b in expected}  # step counts read for these only
    assert set(record.steps) == replayed and replayed < with_grad
    for si in replayed:
        assert record.steps[si] == float(rig.opt.state[rig.plan.slots[si].param]["step"]) + 1
    assert record.step_index == 1 and not record.final
    assert record.scalars == rig.adapter.scalars()
    assert record.nbytes == sum(b.numel * 4 for b in expected) == job.metrics.grad_bytes
    assert job.capture.recorded == {(1, gi) for gi in every_group(rig)} and job.capture.grad_tickets == [record.ticket]
    assert pool.acquired == 1
    record.release()
    assert pool.acquire() is not None and pool.acquire() is not None  # both sets free again


def test_gradients_of_a_step_taken_group_by_group_are_recorded_per_group(rig):
    # DeepSpeed's ZeRO 1/2 step the base optimizer once per param group, narrowing
    # param_groups to that group for the call: each call records its group's blocks only,
    # with that group's scalars under its planned index.
    optimizer_step(rig)
    job = new_job(rig, 3)
    rig.capture.copy_rest(job)
    one_backward(rig, 1)
    pool = GradPool(rig.plan, HostDevice())
    groups, records = rig.opt.param_groups, []
    try:
        for gi in (1, 0):
            rig.opt.param_groups = [groups[gi]]
            assert stepped_groups(rig.plan.fingerprint, rig.opt) == (gi,)
            records.append(rig.capture.gradients(job, 1, (gi,), pool))
            records[-1].ticket.wait()
        with pytest.raises(HookOrderError, match="twice in one training step"):
            rig.capture.gradients(job, 1, (0,), pool)  # group 0 again in the same step
    finally:
        rig.opt.param_groups = groups
    full = rig.adapter.scalars()
    for gi, record in zip((1, 0), records):
        assert record.scalars == {gi: full[gi]}
        assert record.blocks and {rig.plan.slots[b.slot].group for b in record.blocks} == {gi}
    assert job.capture.recorded == {(1, 0), (1, 1)}
    assert stepped_groups(rig.plan.fingerprint, rig.opt) == every_group(rig)
    rig.opt.param_groups = [{**groups[0], "params": groups[0]["params"][:1]}]
    try:  # not a planned group: the plan is stale
        assert stepped_groups(rig.plan.fingerprint, rig.opt) is None
    finally:
        rig.opt.param_groups = groups


def test_gradients_of_window_step_k_minus_1_produce_version_F(rig):
    job = new_job(rig, 2)
    rig.capture.copy_rest(job)
    one_backward(rig, 1)
    record = rig.capture.gradients(job, 1, every_group(rig), GradPool(rig.plan, HostDevice()))
    record.ticket.wait()
    assert record.final


def test_gradients_refuse_a_second_step_in_one_boundary(rig):
    job = new_job(rig, 3)
    rig.capture.enqueue_group(job, 1)
    rig.capture.land_group(job, 1)
    one_backward(rig, 1)
    pool = GradPool(rig.plan, HostDevice())
    rig.capture.gradients(job, 1, every_group(rig), pool).ticket.wait()
    with pytest.raises(HookOrderError, match="twice in one training step"):
        rig.capture.gradients(job, 1, every_group(rig), pool)


def test_gradients_skip_a_step_skipped_by_grad_scaler(rig):
    job = new_job(rig, 3)
    rig.capture.enqueue_group(job, 1)
    rig.capture.land_group(job, 1)
    one_backward(rig, 1)
    rig.opt.found_inf = torch.ones(())  # what GradScaler sets when the step is skipped
    pool = CountingPool(rig.plan, HostDevice())
    assert rig.capture.gradients(job, 1, every_group(rig), pool) is None
    assert job.capture.recorded == set() and pool.acquired == 0
    rig.opt.found_inf = torch.zeros(())
    assert rig.capture.gradients(job, 1, every_group(rig), pool) is not None  # the next, real step is recorded


def test_gradients_refuse_a_fused_step_that_unscales_itself(rig):
    job = new_job(rig, 2)
    one_backward(rig, 1)
    rig.opt.grad_scale = torch.ones(())
    with pytest.raises(ConfigError, match="unscale_"):
        rig.capture.gradients(job, 1, every_group(rig), GradPool(rig.plan, HostDevice()))


def test_a_gradient_laid_out_unlike_its_parameter_is_read_in_the_parameters_order(rig):
    job = new_job(rig, 2)
    rig.capture.enqueue_group(job, 1)
    rig.capture.land_group(job, 1)
    one_backward(rig, 1)
    g = rig.model.hidden.weight.grad
    rig.model.hidden.weight.grad = g.t().contiguous().t()  # same values, transposed layout
    assert not rig.model.hidden.weight.grad.is_contiguous()
    record = rig.capture.gradients(job, 1, every_group(rig), GradPool(rig.plan, HostDevice()))
    record.ticket.wait()
    si = slot_index(rig, "hidden.weight")
    if si in record.grads:  # its blocks were in group 1
        assert torch.equal(record.grads[si], g.reshape(-1))


def test_live_gradients_skip_missing_ones_and_refuse_a_sparse_one():
    model = torch.nn.Linear(3, 2)
    plan = build_plan(model, torch.optim.AdamW(model.parameters()), 1 << 20)
    model.bias.grad = torch.ones(2)
    grads, at = _live_gradients(plan, [0, 1])
    assert grads == {1: model.bias.grad}  # weight: no gradient
    assert at.tolist() == [0, model.bias.grad.data_ptr()]  # (contiguous: read in the same pass)
    model.bias.grad = torch.ones(4)[::2]  # laid out unlike its parameter: read by the copy
    assert _live_gradients(plan, [0, 1])[1] is None
    model.weight.grad = torch.zeros(2, 3).to_sparse()
    with pytest.raises(ConfigError, match="'weight' is a sparse_coo torch.float32 tensor; "
                                          "the replay needs dense"):
        _live_gradients(plan, [0, 1])

