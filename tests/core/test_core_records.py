"""gockpt.core.records: the update kernels (Kernel), one param group's scalars (GroupScalars)
and one step's record (StepRecord)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gockpt.core.blocks import Block, BlockTable
from gockpt.core.records import GroupScalars, Kernel, StepRecord
from gockpt.replay import arithmetic


def test_every_kernel_is_a_name_the_arithmetic_takes_and_back():
    assert {k.value for k in Kernel} == set(arithmetic._ALL_IMPLS)
    assert len(list(Kernel)) == len(arithmetic._ALL_IMPLS)  # no two names for one kernel
    for k in Kernel:  # each one reaches its C++ code in replay_batch's args table
        table = arithmetic._args_table([k], [True], [1e-3], [0.9], [0.999], [1e-8], [0.0],
                                       [1.0], None)
        assert table["impl"].tolist() == [arithmetic._IMPL_CODES[k.value]]
    with pytest.raises(ValueError):
        Kernel("cuda-bogus")
    with pytest.raises(ValueError, match="impl must be one of"):
        arithmetic._args_table(["cuda-bogus"], [True], [1e-3], [0.9], [0.999], [1e-8], [0.0],
                               [1.0], None)


def test_a_kernel_is_its_name():
    assert Kernel.FUSED == "fused" and Kernel("cuda-fused") is Kernel.CUDA_FUSED
    assert str(Kernel.DEEPSPEED_CPU_W16) == "deepspeed-cpu-w16"
    assert f"{Kernel.CUDA_FOREACH}" == "cuda-foreach"
    assert {"single": 1}[Kernel.SINGLE] == 1  # hashes as its name: a dict key for either


def test_the_single_kernel_replays_torch_adamw_bitwise():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(13))
    p.grad = torch.randn(13)
    start = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=False)
    opt.step()
    q, m, v = start.clone(), torch.zeros(13), torch.zeros(13)
    arithmetic.adam_replay(q, m, v, p.grad, impl=Kernel.SINGLE, decoupled=True, lr=1e-2,
                           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1.0)
    assert torch.equal(q, p.detach())
    assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])


def test_deepspeed_cpu_by_vector_width():
    assert Kernel.deepspeed_cpu(8) is Kernel.DEEPSPEED_CPU_W8
    assert Kernel.deepspeed_cpu(1) is Kernel.DEEPSPEED_CPU_W1
    assert Kernel.deepspeed_cpu(16) is Kernel.DEEPSPEED_CPU_W16
    with pytest.raises(ValueError):
        Kernel.deepspeed_cpu(4)  # no such build of the op


def test_group_scalars_are_frozen_values():
    a = GroupScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, Kernel.FUSED, True)
    assert (a.beta1_power, a.beta2_power) == (0.0, 0.0)  # unused unless DeepSpeed's CPU op
    assert a == GroupScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, "fused", True)
    assert a != dataclasses.replace(a, decoupled=False)
    assert len({a, dataclasses.replace(a)}) == 1  # hashable: equal ones are one key
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.lr = 1.0


def test_step_record_defaults_and_its_blocks():
    blocks = [Block(0, 0, 4), Block(1, 2, 6)]
    scalars = {0: GroupScalars(1e-3, 0.9, 0.999, 1e-8, 0.0, Kernel.SINGLE, False)}
    rec = StepRecord(step_index=2, scalars=scalars, steps={0: 3.0, 1: 3.0},
                     table=BlockTable(blocks), grads={0: torch.zeros(4), 1: torch.zeros(6)})
    assert rec.blocks == blocks
    assert (rec.grad_base, rec.ticket, rec.release, rec.nbytes) == (None, None, None, 0)
    assert not rec.final and not rec.snapshot
    assert rec.grad_dtype is torch.float32 and rec.grad_mul == 1.0  # an fp32 transport
    other = StepRecord(1, scalars, {}, BlockTable([]), {})
    assert other.blocks == [] and other.scalars is scalars
