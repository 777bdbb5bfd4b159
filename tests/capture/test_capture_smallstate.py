"""gockpt.capture.smallstate: the small state frozen at F (RNG, buffers, optimizer scalars)."""

from __future__ import annotations

import random

import numpy as np
import torch

from gockpt.capture import smallstate
from gockpt.storage.manifest import expand_columns

import harness as H


def draw():
    return (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)])


def test_rng_capture_then_restore_replays_every_generator():
    H.seed_all(3)
    rng = smallstate.capture_rng()
    assert {"torch", "numpy", "python"} <= set(rng)
    first = draw()
    assert draw() != first  # the generators moved on
    smallstate.restore_rng(rng)
    assert draw() == first


def test_captured_rng_is_a_snapshot():
    H.seed_all(4)
    rng = smallstate.capture_rng()
    first = draw()
    smallstate.restore_rng(rng)
    draw()  # drawing after a restore must not change what was captured
    smallstate.restore_rng(rng)
    assert draw() == first


def test_model_small_excludes_planned_parameters_and_clones():
    model, _, _ = H.build()
    planned = [id(p) for n, p in model.named_parameters() if n != "out.bias"]
    small = smallstate.model_small(model, planned)
    assert set(small) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
                          "out.bias"}  # buffers, and the one parameter the plan left out
    before = small["bn.running_mean"].clone()
    model.bn.running_mean.add_(1.0)
    model.out.bias.data.add_(1.0)
    assert torch.equal(small["bn.running_mean"], before)  # frozen at this version
    assert small["out.bias"].data_ptr() != model.out.bias.data_ptr()
    assert not small["out.bias"].requires_grad


def test_model_small_keeps_extra_state():
    class WithExtra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def get_extra_state(self):
            return {"calls": 3}

        def set_extra_state(self, state):
            pass

    m = WithExtra()
    assert smallstate.model_small(m, [id(m.w)]) == {"_extra_state": {"calls": 3}}


def test_optimizer_small_drops_aligned_keys_gathers_scalars_and_copies():
    model, opt, sched = H.build()
    H.train_steps(model, opt, sched, 1, 2)
    sd = opt.state_dict()
    aligned = {0: ("exp_avg", "exp_avg_sq")}
    small = smallstate.optimizer_small(opt, aligned)
    assert 0 not in small["state"]  # its step is in the column, its moments are aligned
    other = next(i for i in sd["state"] if i != 0)
    assert set(small["state"][other]) == {"exp_avg", "exp_avg_sq"}  # not aligned: kept
    [steps] = small["columns"]["step"]  # every step counter, stacked in one tensor
    assert steps["index"] == list(sd["state"]) and steps["values"].shape == (len(sd["state"]),)
    assert small["param_groups"] == sd["param_groups"]
    p0 = opt.param_groups[0]["params"][0]
    step_before = steps["values"][0].clone()
    opt.state[p0]["step"].add_(5)
    assert torch.equal(steps["values"][0], step_before)  # a copy, frozen
    assert small["state"][other]["exp_avg"].data_ptr() != \
        sd["state"][other]["exp_avg"].data_ptr()
    state = expand_columns(small)  # back in place: what optimizer.state_dict() holds
    assert torch.equal(state[0]["step"], step_before) and state[0]["step"].dim() == 0
    assert set(state[other]) == set(sd["state"][other])


def test_scheduler_state():
    _, _, sched = H.build()
    assert smallstate.scheduler_state(None) is None
    assert smallstate.scheduler_state(sched) == sched.state_dict()
