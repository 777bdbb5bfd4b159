"""``gockpt export --to deepspeed``: a checkpoint written through the DeepSpeed integration, in
DeepSpeed's own layout, loaded by a DeepSpeed without gockpt (gockpt/cli/export_deepspeed.py).

Each case (tests/deepspeed_cases.py: check_export_to_deepspeed) trains a tiny model in fresh
processes: plain DeepSpeed saving its own checkpoint at step S (the reference files, and the
uninterrupted run), the patched engine saving gockpt's at S; exports gockpt's; checks that
every file, key, type and bit is what DeepSpeed wrote; then a DeepSpeed without gockpt (not
installed, not even importable while it builds and loads) loads the export with a plain
``engine.load_checkpoint(OUT)`` and trains on.

Against what: DeepSpeed's CPU Adam keeps beta1^t and beta2^t as float32 running products in
the process and starts a fresh process with pow(beta, t), which differs from the product at
some t (betas (0.9, 0.999): t = 3, 6, 9, 12, 14, 16, 19, ...).  So DeepSpeed's *own* resume is
bitwise with the uninterrupted run only if its first step after the load is none of those
(stage 0's FP16_Optimizer counts one step more than the engine: it steps once at
construction).  The cases save at such steps and compare the loaded run with the uninterrupted
one; the case at step 18 (first step 19) compares it with DeepSpeed's own checkpoint of step
18 loaded the same way -- the export continues exactly as DeepSpeed's own checkpoint would,
where both leave the uninterrupted run.
"""

import json
import shutil

import pytest

from deepspeed_cases import assert_same_deepspeed_checkpoint, check_export_to_deepspeed

pytest.importorskip("deepspeed")  # installed by the README's setup: this never skips in CI

from gockpt.cli import main  # noqa: E402


@pytest.mark.parametrize("stage,world,extra,save_at", [
    (0, 1, {}, 3),                          # FP16_Optimizer (bf16): optimizer in the model states
    (2, 1, {"gas": 2}, 3),
    (1, 1, {"fp32_accumulation": True}, 3),  # BF16_Optimizer
    (1, 1, {"fp16": True, "inf_at": 4}, 4),  # dynamic loss scaler; step 4 overflowed
    (0, 1, {"torch_adam": True}, 3),        # FP16_UnfusedOptimizer (torch's AdamW)
])
def test_export_is_deepspeeds_checkpoint_and_continues_bitwise(tmp_path, stage, world, extra,
                                                               save_at):
    check_export_to_deepspeed(tmp_path, stage, world, extra, save_at, steps=save_at + 2)


def test_export_continues_like_deepspeeds_own_checkpoint_where_its_resume_drifts(tmp_path):
    check_export_to_deepspeed(tmp_path, 1, 1, {}, 18, steps=20, against="native-load")


def test_export_of_zero1_on_two_ranks_and_what_it_refuses(tmp_path, capsys):
    out = check_export_to_deepspeed(tmp_path, 1, 2, {}, 3, steps=5)
    ckpt, config = tmp_path / "gockpt" / "ckpt", tmp_path / "ds_config.json"
    cfg = json.loads(config.read_text())

    def export(*args):
        capsys.readouterr()
        rc = main(["export", *map(str, args)])
        return rc, capsys.readouterr().err

    # The output directory is not empty: --force replaces the tag and latest, nothing else.
    (out / "notes.txt").write_text("mine")
    rc, err = export(ckpt, "--to", "deepspeed", out, "--ds-config", config)
    assert rc == 2 and "--force" in err
    rc, err = export(ckpt, "--to", "deepspeed", out, "--ds-config", config, "--force")
    assert rc == 0, err
    (out / "notes.txt").unlink()
    assert_same_deepspeed_checkpoint(tmp_path / "native" / "ckpt", out)

    # A config that does not build the optimizer that was checkpointed, or another precision.
    for change, match in (({"zero_optimization": {"stage": 0}}, "the checkpoint was written by "
                           "ZeRO 1/2's DeepSpeedZeroOptimizer"),
                          ({"bf16": {"enabled": False}, "fp16": {"enabled": True}},
                           "trains in fp16, the checkpoint's module weights are bf16"),
                          ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3")):
        wrong = tmp_path / "wrong.json"
        wrong.write_text(json.dumps({**cfg, **change}))
        rc, err = export(ckpt, "--to", "deepspeed", tmp_path / "x", "--ds-config", wrong)
        assert rc == 2 and match in err and not (tmp_path / "x").exists(), err

    # Every rank's part is needed; the gockpt run directory is not an output.
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    shutil.rmtree(next(partial.glob("step-*")) / "rank-00001")
    rc, err = export(partial, "--to", "deepspeed", tmp_path / "y", "--ds-config", config)
    assert rc == 1 and "every rank's part" in err and "rank-00001" in err
    rc, err = export(ckpt, "--to", "deepspeed", ckpt, "--ds-config", config, "--force")
    assert rc == 2 and "run directory" in err
    assert (ckpt / "latest").read_text().startswith("step-")
