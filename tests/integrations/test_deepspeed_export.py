"""``gockpt export --to deepspeed``: a checkpoint written through the DeepSpeed integration, in
DeepSpeed's own layout, loaded by a DeepSpeed without gockpt (gockpt/integrations/deepspeed/export.py).

Each case (tests/_support/deepspeed_cases.py: check_export_to_deepspeed) trains a tiny model
in fresh processes: plain DeepSpeed saving its own checkpoint at step S (the reference files,
and the uninterrupted run), the patched engine saving gockpt's at S; exports gockpt's; checks that
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
import logging
import shutil
import types

import pytest
import torch

from tests._support.deepspeed_cases import (assert_same_deepspeed_checkpoint,
                                            check_export_to_deepspeed)

pytest.importorskip("deepspeed")  # installed by the README's setup: this never skips in CI

from gockpt.cli import main  # noqa: E402
from gockpt.integrations.deepspeed.state import (ds_config_record, engine_record,  # noqa: E402
                                                 restore_engine)
from gockpt.storage import tree  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("stage,world,extra,save_at", [
    (0, 1, {}, 3),                          # FP16_Optimizer (bf16): optimizer in the model states
    (0, 2, {}, 3),                          # replicas: the state in shares, put together
    (2, 1, {"gas": 2}, 3),
    (1, 1, {"fp32_accumulation": True}, 3),  # BF16_Optimizer
    (1, 1, {"fp16": True, "inf_at": 4}, 4),  # dynamic loss scaler; step 4 overflowed
    (0, 1, {"torch_adam": True}, 3),        # FP16_UnfusedOptimizer (torch's AdamW)
])
def test_export_is_deepspeeds_checkpoint_and_continues_bitwise(tmp_path, stage, world, extra,
                                                               save_at):
    check_export_to_deepspeed(tmp_path, stage, world, extra, save_at, steps=save_at + 2)


@pytest.mark.slow
def test_export_continues_like_deepspeeds_own_checkpoint_where_its_resume_drifts(tmp_path):
    check_export_to_deepspeed(tmp_path, 1, 1, {}, 18, steps=20, against="native-load")


@pytest.mark.slow
def test_export_of_zero1_on_two_ranks_and_what_it_refuses(tmp_path, capsys, monkeypatch):
    out = check_export_to_deepspeed(tmp_path, 1, 2, {}, 3, steps=5)  # without --ds-config
    ckpt, config = tmp_path / "gockpt" / "ckpt", tmp_path / "ds_config.json"
    native = tmp_path / "native" / "ckpt"
    cfg = json.loads(config.read_text())  # DeepSpeed's ds_config (it agrees with the recorded)

    def export(*args):
        capsys.readouterr()
        rc = main(["export", *map(str, args)])
        return (rc, *capsys.readouterr())

    # The output directory is not empty: --force replaces the tag and latest, nothing else.
    # With --ds-config: the given config is the one written (here DeepSpeed's own).
    (out / "notes.txt").write_text("mine")
    rc, _, err = export(ckpt, "--to", "deepspeed", out, "--ds-config", config)
    assert rc == 2 and "--force" in err
    rc, stdout, err = export(ckpt, "--to", "deepspeed", out, "--ds-config", config, "--force")
    assert rc == 0 and f"ds_config: --ds-config {config}" in stdout, err
    (out / "notes.txt").unlink()
    assert_same_deepspeed_checkpoint(native, out)
    rc, stdout, err = export(ckpt, "--to", "deepspeed", out, "--force")
    assert rc == 0 and "ds_config: the config recorded in the checkpoint" in stdout, err
    assert_same_deepspeed_checkpoint(native, out)

    # --ds-config agreeing with the recorded config on what decides the layout, differing
    # elsewhere: accepted, and what it says is written in every file.
    other = {**cfg, "steps_per_print": 7, "wall_clock_breakdown": True}
    (tmp_path / "other.json").write_text(json.dumps(other))
    rc, _, err = export(ckpt, "--to", "deepspeed", tmp_path / "o", "--ds-config",
                        tmp_path / "other.json")
    assert rc == 0, err
    files = sorted((tmp_path / "o" / "global_step3").iterdir())
    assert len(files) == 3 and all(torch.load(f, weights_only=False)["ds_config"] == other
                                   for f in files)

    # A config that disagrees with the recorded one on what decides the layout: refused,
    # naming each difference; one that cannot be exported at all, before anything is read.
    for change, match in (
            ({"zero_optimization": {"stage": 2}}, ["zero_optimization.stage 2 (recorded: 1)"]),
            ({"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0},
             ["zero_optimization.stage 0 (recorded: 1)", "gradient_clipping 1.0 (recorded: "
              "0.05)"]),
            ({"bf16": {"enabled": False}, "fp16": {"enabled": True}},
             ["precision fp16 (recorded: bf16)"]),
            ({"data_types": {"grad_accum_dtype": "fp32"}},
             ["fp32 gradient accumulation (data_types.grad_accum_dtype) True (recorded: False)"]),
            ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
             ["optimizer offload True (recorded: False)"]),
            ({"zero_optimization": {"stage": 3}}, ["--to deepspeed does not export ZeRO stage 3"])):
        wrong = tmp_path / "wrong.json"
        wrong.write_text(json.dumps({**cfg, **change}))
        rc, _, err = export(ckpt, "--to", "deepspeed", tmp_path / "x", "--ds-config", wrong)
        assert rc == 2 and all(m in err for m in match) and not (tmp_path / "x").exists(), err
        assert len(err.strip().splitlines()) == 1
        if "stage 3" not in match[0]:
            assert "disagrees with the DeepSpeed config recorded in the checkpoint" in err

    # What the recorded config lost (not storable without pickle): outside what decides the
    # layout, a note; inside, refused without --ds-config, and --ds-config is not checked.
    from gockpt.integrations.deepspeed import export as export_deepspeed
    read = export_deepspeed.read_parts

    def recorded(dropped, config=True):
        def _read(sources):
            parts = read(sources)
            for part in parts:
                if config:
                    part.record["ds_config_dropped"] = dropped
                else:  # a checkpoint of a gockpt that did not record the config
                    del part.record["ds_config"], part.record["ds_config_dropped"]
            return parts
        monkeypatch.setattr(export_deepspeed, "read_parts", _read)

    recorded([{"path": ["tensorboard", "writer"], "type": "SummaryWriter"}])
    rc, stdout, err = export(ckpt, "--to", "deepspeed", tmp_path / "n")
    assert rc == 0 and "note: the DeepSpeed config recorded in the checkpoint lacks " \
        "tensorboard.writer: SummaryWriter" in stdout, err
    recorded([{"path": ["zero_optimization", "offload_optimizer"], "type": "Offload"}])
    rc, _, err = export(ckpt, "--to", "deepspeed", tmp_path / "x")
    assert rc == 2 and "zero_optimization.offload_optimizer: Offload" in err \
        and "pass --ds-config" in err and not (tmp_path / "x").exists(), err
    rc, stdout, err = export(ckpt, "--to", "deepspeed", tmp_path / "l", "--ds-config", config)
    assert rc == 0 and "note: --ds-config not checked" in stdout, err
    assert_same_deepspeed_checkpoint(native, tmp_path / "l")

    # A checkpoint without a recorded config (an older gockpt's): --ds-config is needed, and is
    # checked against the checkpoint alone.
    recorded(None, config=False)
    rc, _, err = export(ckpt, "--to", "deepspeed", tmp_path / "x")
    assert rc == 2 and "did not record it; pass --ds-config" in err \
        and not (tmp_path / "x").exists(), err
    for change, match in (({"zero_optimization": {"stage": 0}}, "the checkpoint was written by "
                           "ZeRO 1/2's DeepSpeedZeroOptimizer"),
                          ({"bf16": {"enabled": False}, "fp16": {"enabled": True}},
                           "trains in fp16, the checkpoint's module weights are bf16")):
        wrong = tmp_path / "wrong.json"
        wrong.write_text(json.dumps({**cfg, **change}))
        rc, _, err = export(ckpt, "--to", "deepspeed", tmp_path / "x", "--ds-config", wrong)
        assert rc == 2 and match in err and not (tmp_path / "x").exists(), err
    rc, _, err = export(ckpt, "--to", "deepspeed", tmp_path / "older", "--ds-config", config)
    assert rc == 0, err
    assert_same_deepspeed_checkpoint(native, tmp_path / "older")
    monkeypatch.undo()

    # Every rank's part is needed; the gockpt run directory is not an output.
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    shutil.rmtree(next(partial.glob("step-*")) / "rank-00001")
    rc, _, err = export(partial, "--to", "deepspeed", tmp_path / "y")
    assert rc == 1 and "every rank's part" in err and "rank-00001" in err
    rc, _, err = export(ckpt, "--to", "deepspeed", ckpt, "--force")
    assert rc == 2 and "run directory" in err
    assert (ckpt / "latest").read_text().startswith("step-")


class Unstorable:
    def __repr__(self):
        return "Unstorable()"


class Engine(types.SimpleNamespace):
    """A stand-in for the engine (which, an nn.Module, takes weak references)."""


def test_the_recorded_config_is_what_gockpt_can_store_and_never_fails_the_save(caplog):
    """engine_record's ds_config: the engine's config (DeepSpeed's ds_config) as a copy that
    gockpt.storage.tree stores without pickle; what it cannot store is left out, named, logged
    once; nothing makes the record fail; restore_engine ignores it."""
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": (0.9, 0.95)}},
              "gockpt": {"mode": "gockpt-o"}, "scale": float("inf"), "blob": b"\x00",
              "hook": Unstorable(), "dtype": torch.float16, "callbacks": [1, [Unstorable()]],
              "nested": {"ok": [1, 2.5, "x", None], 3: "int key", "keys": {Unstorable(): 1}}}
    config["itself"] = config
    engine = Engine(config=config, optimizer=types.SimpleNamespace(), global_steps=3,
                    global_samples=12, skipped_steps=0, micro_steps=3)
    with caplog.at_level(logging.WARNING, logger="gockpt"):
        records = [engine_record(engine, {"data_pos": 3}, {}) for _ in range(2)]
    record = records[0]
    tensors = {}
    stored = tree.decode(tree.encode(record, tensors, "extra_state", inline_scalars=True),
                         tensors)
    kept = {k: v for k, v in config.items()
            if k not in ("hook", "dtype", "callbacks", "itself", "nested")}
    kept["nested"] = {"ok": [1, 2.5, "x", None], 3: "int key", "keys": {}}
    assert stored["ds_config"] == kept and stored["ds_config"]["optimizer"]["params"]["betas"] \
        == (0.9, 0.95)
    assert stored["ds_config_dropped"] == [
        {"path": ["hook"], "type": "Unstorable"}, {"path": ["dtype"], "type": "dtype"},
        {"path": ["callbacks"], "type": "list holding list holding Unstorable"},
        {"path": ["nested", "keys", "Unstorable()"], "type": "dict key Unstorable"},
        {"path": ["itself"], "type": "the dict containing it (a cycle)"}]
    assert config["itself"] is config and "hook" in config  # the engine's config untouched
    warned = [r.getMessage() for r in caplog.records if "DeepSpeed config" in r.getMessage()]
    assert len(warned) == 1 and "hook (Unstorable)" in warned[0]  # once per engine

    # A config that cannot be read: none recorded, said why; the save goes on.
    class Broken:
        optimizer = types.SimpleNamespace()
        global_steps = global_samples = skipped_steps = micro_steps = 1

        @property
        def config(self):
            raise RuntimeError("no config here")
    config, dropped = ds_config_record(Broken())
    assert config is None and dropped == [{"path": [], "type": "RuntimeError: no config here"}]
    # An older DeepSpeed keeping the file name: the parsed dict DeepSpeed read from it.
    parsed = {"zero_optimization": {"stage": 2}}
    assert ds_config_record(types.SimpleNamespace(
        config="ds.json", _config=types.SimpleNamespace(_param_dict=parsed))) == (parsed, [])

    # restore_engine puts back the counters and leaves the config alone (an older record has
    # none: the same call).
    fresh = types.SimpleNamespace(optimizer=types.SimpleNamespace(), config={"x": 1})
    restore_engine(fresh, stored)
    assert fresh.global_steps == 3 and fresh.config == {"x": 1}
    del stored["ds_config"], stored["ds_config_dropped"]
    restore_engine(fresh, stored)
