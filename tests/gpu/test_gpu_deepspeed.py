"""The DeepSpeed acceptance cases on a CUDA engine (tests/_support/deepspeed_cases.py; skipped
without a GPU or without DeepSpeed).  One rank (one GPU).  The base optimizer is torch's AdamW
(``torch_adam``), and DeepSpeed's CUDA FusedAdam, built with fast math: its moments replayed, its
parameters copied at F (the last test)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run on a GPU machine)"),
              pytest.mark.slow]
pytest.importorskip("deepspeed")

from tests._support.deepspeed_cases import check_checkpoint_and_resume  # noqa: E402

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


@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_cuda_fused_adam_moments_replayed_parameters_copied_at_f(tmp_path, stage):
    """DeepSpeed's own CUDA FusedAdam (AdamW mode, built with fast math): its moments are
    replayed, its parameters copied at F (issue #19); the checkpoint is the state at F bit for
    bit and the resume goes on bit for bit."""
    check_checkpoint_and_resume(tmp_path, stage, 1, {"options": GOCKPT_O},
                                "bf16" if stage else "fp32")
