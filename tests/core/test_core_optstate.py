"""gockpt.core.optstate: the optimizer state codec -- the small per-parameter state gathered by
key into columns (optimizer_small) and put back in place (expand_columns)."""

from __future__ import annotations

import pytest
import torch

from gockpt.core.optstate import KnownStates, expand_columns, optimizer_small

from tests._support import harness as H


def test_optimizer_small_drops_aligned_keys_gathers_scalars_and_copies():
    model, opt, sched = H.build()
    H.train_steps(model, opt, sched, 1, 2)
    sd = opt.state_dict()
    aligned = {0: ("exp_avg", "exp_avg_sq")}
    small = optimizer_small(opt, aligned)
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
    small = optimizer_small(opt, {})
    assert _expanded(small) == {idx: {k: (v.dtype, v.shape, v.tolist()) if isinstance(
        v, torch.Tensor) else v for k, v in st.items()} for idx, st in sd["state"].items()}


def test_optimizer_small_from_the_plan_equals_state_dict():
    # The fast paths (states and group indices known by the caller; every state alike, or
    # not) hold what optimizer.state_dict() holds; a hook on state_dict, or an extra entry
    # in optimizer.state, sends it back to state_dict() itself.
    model, opt, sched = H.build()
    H.train_steps(model, opt, sched, 1, 2)
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    with_state = [(i, opt.state[p]) for i, p in enumerate(params) if p in opt.state]
    moments = ("exp_avg", "exp_avg_sq")
    aligned = {i: moments for i, _ in with_state}
    known = KnownStates([i for i, _ in with_state], [st for _, st in with_state],
                        [[index[id(p)] for p in g["params"]] for g in opt.param_groups], moments)
    slow = optimizer_small(opt, aligned)
    fast = optimizer_small(opt, aligned, known)
    assert fast["param_groups"] == slow["param_groups"] == opt.state_dict()["param_groups"]
    assert _expanded(fast) == _expanded(slow) and set(fast["columns"]) == {"step"}
    # the values read at every call (what the dicts hold kept while none changed): a step
    # counter changed in place, then one rebound
    with_state[2][1]["step"].add_(5)
    with_state[3][1]["step"] = torch.tensor(11.0)
    for _ in range(2):
        got = _expanded(optimizer_small(opt, aligned, known))
        assert got == _expanded(optimizer_small(opt, aligned))
        assert [got[i]["step"][2] for i in (with_state[2][0], with_state[3][0])] == \
            [float(with_state[2][1]["step"]), 11.0]
    # not every state alike: a step that is a float (the first one read), then also a key
    # of its own
    first, second = with_state[0][1], with_state[1][1]
    kept = first["step"]
    first["step"] = float(kept)
    for _ in range(2):
        assert _expanded(optimizer_small(opt, aligned, known)) == \
            _expanded(optimizer_small(opt, aligned))
        assert optimizer_small(opt, aligned, known)["state"][with_state[0][0]]["step"] == \
            float(kept)
        second["note"] = 7
    assert optimizer_small(opt, aligned, known)["state"][with_state[1][0]]["note"] == 7
    del second["note"]
    first["step"] = kept

    def hook(optimizer, sd):
        sd["param_groups"][0]["marked"] = True
    handle = opt.register_state_dict_post_hook(hook)
    assert optimizer_small(opt, aligned, known)["param_groups"][0]["marked"]
    handle.remove()
    opt.state["extra"] = {"note": 1}  # not a parameter: only state_dict() packs it
    assert optimizer_small(opt, aligned, known)["state"]["extra"] == {"note": 1}


def test_optimizer_small_then_expand_columns_gives_back_the_per_parameter_scalars():
    model, opt, sched = H.build()
    H.train_steps(model, opt, sched, 0, 3)
    sd = opt.state_dict()
    aligned = {i: ("exp_avg", "exp_avg_sq") for i in sd["state"]}
    small = optimizer_small(opt, aligned)
    assert small["state"] == {}  # every scalar in a column, every moment aligned
    state = expand_columns(small)
    assert set(state) == set(sd["state"])
    for idx, st in sd["state"].items():
        assert set(state[idx]) == {"step"}
        got, want = state[idx]["step"], st["step"]
        assert got.dim() == 0 and got.dtype == want.dtype and torch.equal(got, want), idx
        assert got.data_ptr() != want.data_ptr()  # a tensor of its own, not the live one
    assert small["param_groups"] == sd["param_groups"]


def test_expand_columns_puts_each_scalar_in_a_tensor_of_its_own():
    small = {"state": {3: {"note": "kept"}},
             "columns": {"step": [{"index": [1, 3], "values": torch.tensor([4.0, 9.0])}]}}
    state = expand_columns(small)
    assert state is small["state"]  # in place: the decoded section's own dict
    assert state[1]["step"].item() == 4.0 and state[3] == {"note": "kept",
                                                           "step": torch.tensor(9.0)}
    state[1]["step"].add_(1)
    assert small["columns"]["step"][0]["values"].tolist() == [4.0, 9.0]  # not a view
    assert expand_columns({"state": {0: {"x": 1}}}) == {0: {"x": 1}}  # no columns: as it is


def test_expand_columns_refuses_a_column_whose_index_and_values_differ():
    small = {"state": {}, "columns": {"step": [{"index": [0, 1], "values": torch.ones(3)}]}}
    with pytest.raises(ValueError, match="scalar column 'step': 2 indices for 3 values"):
        expand_columns(small)
