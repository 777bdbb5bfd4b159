"""gockpt.capture.smallstate: the small state frozen at F (RNG, buffers, optimizer scalars)."""

from __future__ import annotations

import random

import numpy as np
import torch

from gockpt.capture import smallstate

from tests._support import harness as H


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


def test_scheduler_state():
    _, _, sched = H.build()
    assert smallstate.scheduler_state(None) is None
    assert smallstate.scheduler_state(sched) == sched.state_dict()


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


def test_model_small_walk_names_wrapped_models_as_state_dict_does_without_them():
    """The C++ walk against state_dict(): wrappers (DataParallel's ``module``, torch.compile,
    activation checkpointing) dropped from the names, a plain child named ``module`` kept,
    None parameters and buffers skipped, a module type seen for the first time classified,
    and one that saves its state its own way handed to state_dict()."""
    inner = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    inner.register_parameter("unset", None)
    inner.register_buffer("nothing", None)
    outer = torch.nn.Module()
    outer.module = inner  # a plain child named "module": part of the names
    outer.block = torch.nn.Module()
    outer.block._checkpoint_wrapped_module = torch.nn.BatchNorm1d(2)
    planned = {id(p): None for p in outer.parameters()}
    expected = ["module.1.running_mean", "module.1.running_var", "module.1.num_batches_tracked",
                "block.running_mean", "block.running_var", "block.num_batches_tracked"]
    assert list(smallstate.model_small(outer, planned)) == expected
    wrapped = torch.nn.DataParallel(torch.compile(outer, backend="eager"))
    assert list(smallstate.model_small(wrapped, planned)) == expected

    class NewKind(torch.nn.Module):  # never seen: classified on the way
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))
    outer.new = NewKind()
    assert list(smallstate.model_small(outer, planned)) == expected + ["new.count"]

    class OwnSave(torch.nn.Module):  # its state is what its own method says
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            destination[prefix + "own"] = torch.ones(1)
    outer.block.own = OwnSave()
    assert "block.own.own" in smallstate.model_small(outer, planned)


def test_model_small_kept_walk_sees_every_change_of_what_it_read():
    """A walk kept across calls (``walks``) answers as a fresh one after each kind of change
    of the model: each call compared with model_small without it, and the calls answered
    without a walk counted (none after a change; a kept walk only where dicts have versions,
    CPython <= 3.11)."""
    import sys
    from gockpt import _tensors
    model, _, _ = H.build()
    planned = {id(p): None for p in model.parameters()}
    walks = _tensors.ModuleWalkCache()
    keeps = sys.version_info < (3, 12)

    def same(kept: bool):
        hits = walks.hits
        got = smallstate.model_small(model, planned, walks)
        want = smallstate.model_small(model, planned)
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                   else got[k] == want[k] for k in want)
        assert walks.hits - hits == (1 if kept and keeps else 0)
        return got

    same(False)
    same(True)  # nothing changed: the walk kept
    model.bn.running_mean.add_(1.0)  # values are read at every call, walked or not
    assert torch.equal(same(True)["bn.running_mean"], model.bn.running_mean)
    model.bn.running_mean = torch.full_like(model.bn.running_mean, 3.0)  # a buffer rebound
    assert same(False)["bn.running_mean"][0] == 3.0
    model.bn.register_buffer("extra", torch.ones(1))  # a buffer added
    assert "bn.extra" in same(False)
    same(True)
    model.bn._non_persistent_buffers_set.add("extra")  # made non-persistent (a set: no version)
    assert "bn.extra" not in same(False)
    model.out.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))  # not planned
    assert "out.scale" in same(False)
    planned[id(model.out.scale)] = None  # the plan's ids changed
    assert "out.scale" not in same(False)
    model.added = torch.nn.BatchNorm1d(2)  # a child added
    assert "added.running_var" in same(False)
    model.train(False)  # an attribute set on every module: walked again, the same entries
    same(False)
    same(True)

    class OwnSave(torch.nn.BatchNorm1d):
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            destination[prefix + "own"] = torch.ones(1)
    model.added.__class__ = OwnSave  # another class: state_dict() asked
    assert "added.own" in same(False)
    model.added.__class__ = torch.nn.BatchNorm1d
    same(False)
    model.bn._register_state_dict_hook(lambda m, sd, prefix, meta: sd.update(
        {prefix + "hooked": torch.zeros(1)}))  # a hook: state_dict() asked, never kept
    assert "bn.hooked" in same(False)
    assert "bn.hooked" in same(False)
