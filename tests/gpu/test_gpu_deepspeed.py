"""The DeepSpeed acceptance cases on a CUDA engine (tests/_support/deepspeed_cases.py; skipped
without a GPU or without DeepSpeed).  One rank (one GPU).  The base optimizer is torch's AdamW
(``torch_adam``): DeepSpeed's CUDA FusedAdam is built with fast math and has no exact replay, so
the replay modes refuse it (tested below) and the copy modes checkpoint it."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run on a GPU machine)"),
              pytest.mark.slow]
pytest.importorskip("deepspeed")

from tests._support.deepspeed_cases import check_checkpoint_and_resume, runs  # noqa: E402

GOCKPT_O = {"mode": "gockpt-o", "overlap_steps": 3, "block_bytes": 2048}  # window 16..18


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("options", [{"mode": "async-o"}, GOCKPT_O])
def test_bf16_checkpoint_is_the_state_at_f_and_resumes_bitwise(tmp_path, stage, options):
    # on a GPU, ZeRO 1/2 in bf16 carry the replayed gradients in bf16 by default; ZeRO 0 in
    # bf16 is DeepSpeed's BF16_Optimizer (fp32 gradient accumulation): fp32
    transport = None if options["mode"] == "async-o" else "bf16" if stage else "fp32"
    check_checkpoint_and_resume(tmp_path, stage, 1, {"options": options, "torch_adam": True},
                                transport)


@pytest.mark.parametrize("options", [{"mode": "async-o"}, GOCKPT_O])
def test_fp16_with_an_overflow_step_inside_the_checkpoint_window(tmp_path, options):
    # step 19 overflows (skipped by DeepSpeed's dynamic loss scaler): F = 20 in gockpt-o
    check_checkpoint_and_resume(tmp_path, 1, 1, {"options": options, "torch_adam": True,
                                                 "fp16": True, "inf_at": 19})


def test_gradient_accumulation_and_two_param_groups(tmp_path):
    check_checkpoint_and_resume(tmp_path, 2, 1, {"options": GOCKPT_O, "torch_adam": True,
                                                 "gas": 2, "two_groups": True}, "bf16")


def test_deepspeed_cuda_fused_adam_is_refused_by_the_replay_modes(tmp_path):
    with pytest.raises(AssertionError, match="cannot replay"):  # the worker's ConfigError
        runs(tmp_path, 1, stage=1, steps=2, save_at=1, options=GOCKPT_O)("save")
