"""gockpt.storage.statedict: the model's and the optimizer's state dicts as a checkpoint stores
them, rebuilt without a model or optimizer to restore them into."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import gockpt
from gockpt import storage
from gockpt.core.errors import CorruptCheckpointError, LoadError
from gockpt.core.optstate import optimizer_small
from gockpt.storage import manifest as M, schema as S, tree
from gockpt.storage.refs import TensorRef
from gockpt.storage.statedict import model_state, optimizer_state, optimizer_state_dict

from tests._support import harness as H


def ref(name, *a, **k):
    return TensorRef(name, *a, **k)


# ------------------------------------------------------------------ optimizer_state_dict

def saved(opt):
    """A manifest and its small tensors as a checkpoint of ``opt`` stores them."""
    aligned = {i: ["exp_avg", "exp_avg_sq"] for i in range(len(opt.state))}
    tensors = {}
    small = S.SmallSection(optimizer=tree.encode(optimizer_small(opt, aligned),
                                                 tensors, S.small_prefix("optimizer")))
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key in aligned[i]:
            tensors[S.optim_tensor(i, key)] = opt.state[p][key].clone()
    refs = {i: {k: ref(S.optim_tensor(i, k)) for k in keys} for i, keys in aligned.items()}
    m = S.Manifest(7, 5, "gockpt", 3, S.ModelSection({}), small,
                   S.OptimizerSection(type(opt).__name__, refs))
    return m, tensors


def two_group_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()},
                             {"params": model[1].parameters(), "lr": 0.1}])
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_dict_rebuilds_the_live_state_dict():
    model, opt = two_group_adamw()
    m, tensors = saved(opt)
    sd = optimizer_state_dict(m, "ck", tensors, opt)
    live = opt.state_dict()
    assert sd["param_groups"] == live["param_groups"]
    assert set(sd["state"]) == set(live["state"])
    for i, st in live["state"].items():
        assert set(sd["state"][i]) == set(st)
        for key, value in st.items():
            assert torch.equal(sd["state"][i][key], value), (i, key)
    light = optimizer_state_dict(m, "ck", tensors, opt, aligned=False)
    assert all(set(st) == {"step"} for st in light["state"].values())


def test_optimizer_state_dict_refuses_another_class():
    model, opt = two_group_adamw()
    m, tensors = saved(opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(LoadError, match="saved with optimizer AdamW, loading into SGD"):
        optimizer_state_dict(m, "ck", tensors, sgd)


def test_optimizer_state_dict_refuses_other_group_or_parameter_counts():
    model, opt = two_group_adamw()
    m, tensors = saved(opt)
    one_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(LoadError, match="1 groups / 4 parameters, the checkpoint 2 / 4"):
        optimizer_state_dict(m, "ck", tensors, one_group)
    fewer = torch.optim.AdamW([{"params": model[0].parameters()},
                               {"params": [model[1].weight]}])
    with pytest.raises(LoadError, match="2 groups / 3 parameters, the checkpoint 2 / 4"):
        optimizer_state_dict(m, "ck", tensors, fewer)


# ------------------------------------------------------------------ a checkpoint written for real

def written(tmp_path, model, opt, sched=None, steps=3, **options):
    """Train ``steps`` steps with a checkpoint of the last one (F: the live state after it);
    returns the checkpoint's path, typed manifest and stored tensors."""
    with gockpt.Checkpointer(model, opt, str(tmp_path), scheduler=sched, **options) as ck:
        H.train_steps(model, opt, sched, 0, steps, ck, force={steps})
    path = os.path.join(str(tmp_path), storage.checkpoint_name(steps))
    m = M.parse(path, storage.read_manifest(path))
    return path, m, storage.read_tensors(path, m)


def assert_same_state(got: dict, want: dict):
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k


@pytest.mark.parametrize("mode,options", [("async", {}), ("gockpt-o", {"overlap_steps": 2}),
                                          ("sync", {"block_bytes": 1 << 20})])
def test_a_checkpoint_holds_the_live_state_dicts(tmp_path, mode, options):
    H.seed_all(0)
    model, opt, sched = H.build()
    path, m, tensors = written(tmp_path, model, opt, sched, mode=mode, **options)
    sd, aliases = model_state(path, m, tensors)
    assert aliases == {}
    assert_same_state(sd, model.state_dict())
    live = opt.state_dict()
    osd = optimizer_state(path, m, tensors)
    assert osd["param_groups"] == live["param_groups"]
    assert list(osd["state"]) == sorted(live["state"])  # in index order
    for i, st in live["state"].items():
        assert_same_state(osd["state"][i], st)
    again = optimizer_state_dict(m, path, tensors, opt)  # checked against the live optimizer
    assert again["param_groups"] == live["param_groups"]
    for i, st in live["state"].items():
        assert_same_state(again["state"][i], st)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, step):
        return self.head(self.emb(x).mean(1))


def test_tied_names_share_their_canonical_tensor(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the harness's loop with a batch this model takes
    monkeypatch.setattr(H, "batch", lambda step: (torch.tensor([[step % 6, 1], [2, 3]]),
                                                  torch.tensor([0, 5])))
    path, m, tensors = written(tmp_path, model, opt, mode="async")
    sd, aliases = model_state(path, m, tensors)
    assert set(sd) == {"emb.weight", "head.weight"}
    [(alias, canonical)] = aliases.items()
    assert sd[alias] is sd[canonical]  # one tensor, as in the model
    assert torch.equal(sd["emb.weight"], model.emb.weight.detach())


def test_an_unusable_section_is_a_corrupt_checkpoint(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    path, m, tensors = written(tmp_path, model, opt, sched, mode="async")
    first = next(iter(m.model.params.values())).tensor
    with pytest.raises(CorruptCheckpointError, match="manifest has no usable model section"):
        model_state(path, m, {k: v for k, v in tensors.items() if k != first})
    small = [k for k in tensors if k.startswith(S.small_prefix("optimizer"))]
    assert small  # the step counters' column at least
    with pytest.raises(CorruptCheckpointError, match="manifest has no usable optimizer section"):
        optimizer_state(path, m, {k: v for k, v in tensors.items() if k not in small})
