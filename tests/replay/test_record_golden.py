"""experiments/record_golden.py, the recorder the GPU round runs to check every replay profile
against the kernels of the GPU at hand: run here on the CPU, it must write what the golden tests
read (the stored H100 vectors' inputs and layout), and what it writes must be the optimizer's
own results (the CPU profiles replay them bit for bit)."""

import importlib.util
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import gockpt
from tests.replay.test_replay_arithmetic_golden import STORED, mismatches

RECORDER = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "record_golden.py")
# torch's implementations on the CPU: forloop is the "single" tensor path there
CPU_PROFILE = {"forloop": "single", "foreach": "foreach", "fused": "fused"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("record_golden", RECORDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = str(tmp_path_factory.mktemp("golden") / "cpu.safetensors")
    meta = module.record(out, "cpu", with_deepspeed=False)
    with safe_open(out, "pt") as f:
        assert json.loads(f.metadata()["golden"]) == meta
    return meta, load_file(out)


def test_the_recorder_writes_the_stored_vectors_inputs_and_layout(recorded):
    meta, tensors = recorded
    stored = load_file(STORED)
    with safe_open(STORED, "pt") as f:
        stored_meta = json.loads(f.metadata()["golden"])
    inputs = sorted(k for k in stored if k.startswith("input/"))
    assert inputs == sorted(k for k in tensors if k.startswith("input/"))
    for key in inputs:  # the same inputs: fresh vectors answer the same question
        assert mismatches(tensors[key], stored[key]) == 0, key
    torch_keys = {k for k in stored if k.startswith("torch/")}
    assert torch_keys == set(tensors) - set(inputs)
    for key in ("n", "trajectory_steps", "jumps"):
        assert meta[key] == stored_meta[key], key
    stored_cases = [c for c in stored_meta["cases"] if c["name"].startswith("torch/")]
    assert meta["cases"] == stored_cases


@pytest.mark.parametrize("name", ["torch/AdamW/forloop/h0", "torch/Adam/foreach/h2",
                                  "torch/AdamW/fused/h1", "torch/Adam/forloop/h2"])
def test_what_is_recorded_is_the_optimizers_own_result(recorded, name):
    """The CPU kernels' states after each step, as the replay of their CPU profile computes
    them from the recorded inputs -- which holds only if the recorder kept each step's state,
    and each jump's step count as the optimizer saw them."""
    meta, tensors = recorded
    case = next(c for c in meta["cases"] if c["name"] == name)
    _, opt, impl, _ = name.split("/")
    arith = f"cpu/torch/{opt}/{CPU_PROFILE[impl.replace('-gradscale', '')]}"
    kw = dict(lr=case["lr"], betas=tuple(case["betas"]), eps=case["eps"],
              weight_decay=case["weight_decay"])

    def grad(t):
        return tensors[f"input/grad{t}"].clone()

    state = [tensors["input/param"].clone(), torch.zeros(meta["n"]), torch.zeros(meta["n"])]
    for t in range(1, meta["trajectory_steps"] + 1):
        gockpt.replay_step(arith, *state, grad(t), step=t, **kw)
        for part, x in zip(("param", "exp_avg", "exp_avg_sq"), state):
            assert mismatches(x, tensors[f"{name}/t{t}/{part}"]) == 0, (t, part)
    for jump in meta["jumps"]:
        state = [tensors[f"{name}/t6/{part}"].clone()
                 for part in ("param", "exp_avg", "exp_avg_sq")]
        gockpt.replay_step(arith, *state, grad(1), step=jump, **kw)
        for part, x in zip(("param", "exp_avg", "exp_avg_sq"), state):
            assert mismatches(x, tensors[f"{name}/jump{jump}/{part}"]) == 0, (jump, part)
