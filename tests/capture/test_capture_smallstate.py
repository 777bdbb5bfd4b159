"""gockpt.capture.smallstate: the small state frozen at F (RNG, buffers, optimizer scalars)."""

from __future__ import annotations

import random

import numpy as np
import torch

from gockpt.capture import smallstate
from gockpt.core.optstate import expand_columns

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


def _expanded(small: dict) -> dict:
    """Every state entry of an optimizer small section, columns put back, as plain values."""
    return {idx: {k: (v.dtype, v.shape, v.tolist()) if isinstance(v, torch.Tensor) else v
                  for k, v in st.items()}
            for idx, st in expand_columns(small).items()}


def test_optimizer_small_keeps_every_odd_scalar_as_it_is():
    # Step counters of other kinds side by side: a float, a 1-element 1-D tensor, a float64
    # tensor among float32 ones. Each comes back with its own type, shape and dtype.
    model, opt, sched = H.build()
    H.train_steps(model, opt, sched, 1, 2)
    states = list(opt.state.values())
    states[0]["step"] = 7.0
    states[1]["step"] = torch.tensor([3.0])
    states[2]["step"] = torch.tensor(5.0, dtype=torch.float64)
    sd = opt.state_dict()
    small = smallstate.optimizer_small(opt, {})
    assert _expanded(small) == {idx: {k: (v.dtype, v.shape, v.tolist()) if isinstance(
        v, torch.Tensor) else v for k, v in st.items()} for idx, st in sd["state"].items()}


def test_optimizer_small_from_the_plan_equals_state_dict():
    # The fast path (states and group indices known by the caller) holds what
    # optimizer.state_dict() holds; a hook on state_dict, or an extra entry in
    # optimizer.state, sends it back to state_dict() itself.
    model, opt, sched = H.build()
    H.train_steps(model, opt, sched, 1, 2)
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    known = ([(i, opt.state[p]) for i, p in enumerate(params) if p in opt.state],
             [[index[id(p)] for p in g["params"]] for g in opt.param_groups])
    aligned = {0: ("exp_avg", "exp_avg_sq")}
    slow = smallstate.optimizer_small(opt, aligned)
    fast = smallstate.optimizer_small(opt, aligned, known)
    assert fast["param_groups"] == slow["param_groups"] == opt.state_dict()["param_groups"]
    assert _expanded(fast) == _expanded(slow)

    def hook(optimizer, sd):
        sd["param_groups"][0]["marked"] = True
    handle = opt.register_state_dict_post_hook(hook)
    assert smallstate.optimizer_small(opt, aligned, known)["param_groups"][0]["marked"]
    handle.remove()
    opt.state["extra"] = {"note": 1}  # not a parameter: only state_dict() packs it
    assert smallstate.optimizer_small(opt, aligned, known)["state"]["extra"] == {"note": 1}


def test_model_small_walk_equals_state_dict_and_defers_to_hooks():
    model, _, _ = H.build()
    model.register_buffer("transient", torch.ones(2), persistent=False)
    model.shared = model.bn  # one module under two names: state_dict() lists it twice
    planned = {id(p) for p in model.parameters()}
    reference = {k: v for k, v in model.state_dict(keep_vars=True).items()
                 if id(v) not in planned}
    small = smallstate.model_small(model, planned)
    assert list(small) == list(reference)  # same entries, same order
    assert "shared.running_mean" in small and "transient" not in small
    assert all(torch.equal(small[k], reference[k]) for k in small)

    def hook(module, sd, prefix, local_metadata):
        sd[prefix + "added"] = torch.zeros(1)
    model.bn._register_state_dict_hook(hook)
    assert "bn.added" in smallstate.model_small(model, planned)
