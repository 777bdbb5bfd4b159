"""gockpt.core.names: state-dict names without wrapper prefixes, and data-parallel replicas."""

from __future__ import annotations

import torch
from torch import nn

from gockpt.core.names import Names, is_replicated, is_wrapper_child


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))


def test_an_unwrapped_model_keeps_its_names():
    model = net()
    names = Names(model)
    assert names.identity
    assert names.clean_all(model.state_dict()) == {n: n for n in model.state_dict()}


def test_data_parallel_module_prefix_is_dropped():
    model = net()
    wrapped = nn.DataParallel(model)  # (on the CPU: no device, the module as it is)
    names = Names(wrapped)
    assert not names.identity
    assert names.clean("module.0.weight") == "0.weight"
    assert names.clean_all(wrapped.state_dict()) == {
        n: "module." + n for n in model.state_dict()}
    assert is_wrapper_child(wrapped, "module")


def test_a_child_named_module_of_a_plain_model_is_not_a_wrapper():
    outer = nn.Module()
    outer.module = net()
    names = Names(outer)
    assert names.identity and names.clean("module.0.weight") == "module.0.weight"
    assert not is_wrapper_child(outer, "module")


def test_torch_compile_and_nested_wrapper_prefixes_are_dropped():
    model = net()
    compiled = torch.compile(model, backend="eager")
    assert Names(compiled).clean_all(compiled.state_dict()) == {
        n: "_orig_mod." + n for n in model.state_dict()}
    # a wrapper inside the model: activation checkpointing's child
    outer = nn.Module()
    outer.block = nn.Module()
    outer.block._checkpoint_wrapped_module = nn.Linear(2, 2)
    names = Names(outer)
    assert names.clean("block._checkpoint_wrapped_module.weight") == "block.weight"
    assert all(is_wrapper_child(outer, c) for c in ("_orig_mod", "_fsdp_wrapped_module"))


def test_a_name_outside_the_walked_modules_is_kept():
    names = Names(nn.DataParallel(net()))
    assert names.clean("module.0.weight") == "0.weight"
    assert names.clean("elsewhere.weight") == "elsewhere.weight"
    assert names.clean("bias") == "bias"  # the root's own entry


def test_is_replicated():
    model = net()
    assert not is_replicated(model)
    assert is_replicated(nn.DataParallel(model))
    assert not is_replicated(torch.compile(model, backend="eager"))
    assert is_replicated(torch.compile(nn.DataParallel(model), backend="eager"))
