"""gockpt.testing: snapshots are independent deep copies that survive torch.save with
weights_only, and the comparison finds every kind of difference (bits, types, keys)."""

from __future__ import annotations

import collections
import io
import random

import numpy as np
import pytest
import torch

from gockpt.testing import assert_same, first_difference, snapshot


def trained(seed=0):
    """A tiny model, AdamW with state, a scheduler, after two steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(2):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_snapshot_sections_and_rng():
    model, opt, sched = trained()
    snap = snapshot(model, opt, sched)
    assert set(snap) == {"model", "optimizer", "scheduler", "rng"}
    assert set(snap["model"]) == set(model.state_dict())
    assert snap["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert snap["scheduler"]["last_epoch"] == 2
    assert {"torch", "numpy", "python"} <= set(snap["rng"])
    assert torch.equal(snap["rng"]["torch"], torch.get_rng_state())
    name, keys, pos = snap["rng"]["numpy"][:3]
    assert name == "MT19937" and keys.dtype == torch.int64 and keys.numel() == 624
    assert pos == np.random.get_state()[2]
    assert snap["rng"]["python"] == random.getstate()


def test_snapshot_without_optimizer_or_scheduler():
    model, _, _ = trained()
    snap = snapshot(model)
    assert snap["optimizer"] is None and snap["scheduler"] is None
    assert_same(snap, snapshot(model))


def test_snapshot_is_a_deep_copy():
    model, opt, sched = trained()
    snap = snapshot(model, opt, sched)
    original = model[0].weight[1, 2].item()
    with torch.no_grad():
        model[0].weight[1, 2] = original + 1.0
    opt.param_groups[0]["lr"] = 5.0
    opt.state[model[0].bias]["exp_avg"].zero_()
    diff = first_difference(snap, snapshot(model, opt, sched))
    assert diff == "['model']['0.weight']: 1 of 12 elements differ"
    # the other changes are found once the model is put back
    with torch.no_grad():
        model[0].weight[1, 2] = original
    assert_same(snap["model"], snapshot(model)["model"])
    diff = first_difference(snap["optimizer"], snapshot(model, opt)["optimizer"], "opt")
    assert diff is not None and diff.startswith("opt['state']") and "exp_avg" in diff


def test_rng_draws_change_the_snapshot():
    model, opt, sched = trained()
    before = snapshot(model, opt, sched)
    torch.rand(1)
    assert first_difference(before["rng"], snapshot(model)["rng"], "rng").startswith(
        "rng['torch']")
    torch.set_rng_state(before["rng"]["torch"])
    np.random.rand()
    assert first_difference(before["rng"], snapshot(model)["rng"], "rng").startswith(
        "rng['numpy']")  # the keys, or only the position, depending on where numpy's MT was


def test_snapshot_survives_torch_save_weights_only():
    model, opt, sched = trained()
    snap = snapshot(model, opt, sched)
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    assert_same(snap, torch.load(buf, weights_only=True))


def test_tensors_compared_by_bits():
    assert first_difference(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])) == \
        "value: 1 of 2 elements differ"
    nan = torch.tensor([float("nan"), 2.0])
    assert first_difference(nan, nan.clone()) is None
    other_nan = nan.clone()
    other_nan.view(torch.int32)[0] ^= 1  # another NaN payload
    assert first_difference(nan, other_nan) == "value: 1 of 2 elements differ"
    assert first_difference(torch.tensor(3), torch.tensor(3)) is None  # 0-dim
    assert first_difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64), "t") == \
        "t: torch.float32[2] vs torch.float64[2]"
    assert first_difference(torch.zeros(2), torch.zeros(1, 2), "t") == \
        "t: torch.float32[2] vs torch.float32[1, 2]"
    assert first_difference(torch.zeros(2), [0.0, 0.0], "t") == "t: Tensor vs list"


def test_numpy_arrays_and_scalars():
    a = np.arange(4, dtype=np.uint32)
    assert first_difference(a, a.copy()) is None
    assert first_difference(a, a.astype(np.int64), "a") == "a: uint32[4] vs int64[4]"
    b = a.copy()
    b[3] = 9
    assert first_difference(a, b, "a") == "a: numpy arrays differ"
    assert first_difference(np.float32(1.5), np.float32(1.5)) is None
    assert first_difference(np.float32(1.5), np.float64(1.5)) is not None


def test_scalars_by_type_and_bits():
    assert first_difference(1, 1.0, "x") == "x: int 1 vs float 1.0"
    assert first_difference(True, 1, "x") == "x: bool True vs int 1"
    assert first_difference(0.0, -0.0, "x") == "x: 0.0 != -0.0"
    assert first_difference(float("nan"), float("nan")) is None
    assert first_difference("a", "b", "x") == "x: 'a' != 'b'"
    assert first_difference(None, None) is None


def test_containers():
    assert first_difference((1, 2), [1, 2], "c") == "c: tuple vs list"
    assert first_difference([1, 2], [1, 2, 3], "c") == "c: length 2 vs 3"
    assert first_difference({"a": [1, (2, 3)]}, {"a": [1, (2, 4)]}, "c") == "c['a'][1][1]: 3 != 4"
    assert first_difference({"a": 1, "b": 2}, {"a": 1, "c": 2}, "c") == \
        "c: keys differ, only in the first ['b'], only in the second ['c']"
    assert first_difference({"a": 1}, collections.OrderedDict(a=1)) is None
    assert first_difference({0: 1}, [1], "c") == "c: dict vs list"
    point = collections.namedtuple("point", "x y")
    assert first_difference(point(1, 2), (1, 2), "c") == "c: point vs tuple"


def test_assert_same_names_the_difference():
    assert_same({"w": torch.ones(3)}, {"w": torch.ones(3)})
    with pytest.raises(AssertionError, match=r"^rank 1: \['w'\]: 1 of 3 elements differ$"):
        assert_same({"w": torch.ones(3)}, {"w": torch.tensor([1.0, 2.0, 1.0])}, "rank 1")
    with pytest.raises(AssertionError, match=r"^value: 1 != 2$"):
        assert_same(1, 2)
