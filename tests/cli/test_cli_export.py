"""Tests of `gockpt export` (gockpt/cli/export.py): files that plain torch and safetensors load,
and the usage of `--to deepspeed` (gockpt/integrations/deepspeed/export.py)."""

import json
import os

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.testing import assert_same, first_difference

from tests._support.cli_helpers import make_model, train, flip_byte, run, part_dir, _part_model

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_export_torch_round_trips_bitwise(run_dir, tmp_path, capsys):
    out_file = str(tmp_path / "ckpt.pt")
    rc, out, err = run(capsys, "export", run_dir, "--to", "torch", out_file)
    assert rc == 0, err
    assert "step 7" in out

    ref_model, ref_opt = make_model()
    gockpt.load(run_dir, ref_model, ref_opt, restore_rng=False)

    obj = torch.load(out_file, weights_only=True)  # plain torch, no gockpt, no pickle of code
    model, opt = make_model()
    model.load_state_dict(obj["model"])
    opt.load_state_dict(obj["optimizer"])
    assert obj["step"] == 7
    assert list(obj["model"]) == list(ref_model.state_dict())
    assert_same(model.state_dict(), ref_model.state_dict())
    assert_same(opt.state_dict(), ref_opt.state_dict())
    # and the optimizer keeps working identically after loading
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    assert_same(model.state_dict(), ref_model.state_dict())


def test_export_safetensors_round_trips_bitwise(run_dir, tmp_path, capsys):
    out_file = str(tmp_path / "model.safetensors")
    ckpt = os.path.join(run_dir, "step-000000004")
    rc, out, err = run(capsys, "export", ckpt, "--to", "safetensors", out_file)
    assert rc == 0, err
    sd = safetensors_torch.load_file(out_file)
    ref_model, _ = make_model()
    gockpt.load(run_dir, ref_model, tag="step-000000004", restore_rng=False)
    assert_same(sd, dict(ref_model.state_dict()))
    model, _ = make_model()
    model.load_state_dict(sd)  # strict
    from safetensors import safe_open
    with safe_open(out_file, "pt") as f:
        assert f.metadata()["gockpt_step"] == "4"


def test_export_tied_parameters(tmp_path, capsys):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(1)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    train(tmp_path / "run", model, opt, steps=4, inputs=8)
    assert storage.read_manifest(storage.resolve(str(tmp_path / "run")))["model"]["aliases"] \
        == {"b.weight": "a.weight"}

    st, pt = str(tmp_path / "m.safetensors"), str(tmp_path / "m.pt")
    rc, out, err = run(capsys, "export", str(tmp_path / "run"), "--to", "safetensors", st)
    assert rc == 0, err
    assert "'b.weight' written as a separate copy of 'a.weight'" in out
    sd = safetensors_torch.load_file(st)
    assert set(sd) == set(model.state_dict())
    assert torch.equal(sd["a.weight"], sd["b.weight"])
    fresh = Tied()
    fresh.load_state_dict(sd)
    assert_same(fresh.state_dict(), model.state_dict())

    rc, _, err = run(capsys, "export", str(tmp_path / "run"), "--to", "torch", pt)
    assert rc == 0, err
    obj = torch.load(pt, weights_only=True)
    assert obj["model"]["b.weight"] is obj["model"]["a.weight"]  # tied, as torch saves it
    fresh, fresh_opt = Tied(), None
    fresh.load_state_dict(obj["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh_opt.load_state_dict(obj["optimizer"])
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fresh_opt.state_dict(), opt.state_dict())


def test_export_refuses_to_overwrite(run_dir, tmp_path, capsys):
    out_file = tmp_path / "x.pt"
    out_file.write_bytes(b"keep me")
    rc, out, err = run(capsys, "export", run_dir, "--to", "torch", str(out_file))
    assert rc == 2 and "--force" in err and out_file.read_bytes() == b"keep me"
    rc, _, err = run(capsys, "export", run_dir, "--to", "torch", str(out_file), "--force")
    assert rc == 0, err
    assert torch.load(str(out_file), weights_only=True)["step"] == 7


def test_export_of_corrupt_checkpoint_fails_and_writes_nothing(run_copy, tmp_path, capsys):
    flip_byte(os.path.join(run_copy, "step-000000007"), "model/0.bias")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, out, err = run(capsys, "export", run_copy, "--to", "safetensors",
                       str(out_dir / "m.safetensors"))
    assert rc == 1
    assert "'model/0.bias'" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(out_dir) == []


def test_ranks_export_selects_the_rank(ranks_dir, tmp_path, capsys):
    from tests._support import harness
    want = [_part_model(part_dir(ranks_dir, r)) for r in range(2)]
    assert first_difference(want[0], want[1]) is not None  # every rank trained its own state

    pt = str(tmp_path / "r1.pt")
    rc, out, err = run(capsys, "export", ranks_dir, "--to", "torch", pt, "--rank", "1")
    assert rc == 0, err
    assert "rank 1 of 2" in out and "rank-00001" in out and "step 4" in out
    obj = torch.load(pt, weights_only=True)
    assert obj["step"] == 4 and obj["rank"] == 1 and obj["world_size"] == 2
    assert_same(obj["model"], want[1])
    model, opt, sched = harness.build(seed=7)
    model.load_state_dict(obj["model"])  # strict
    opt.load_state_dict(obj["optimizer"])
    assert_same(dict(model.state_dict()), want[1])

    st = str(tmp_path / "r1.safetensors")
    rc, out, err = run(capsys, "export", ranks_dir, "--to", "safetensors", st, "--rank", "1")
    assert rc == 0, err
    assert_same(safetensors_torch.load_file(st), want[1])
    from safetensors import safe_open
    with safe_open(st, "pt") as f:
        assert f.metadata()["gockpt_rank"] == "1" and f.metadata()["gockpt_world_size"] == "2"

    st0 = str(tmp_path / "r0.safetensors")  # default: rank 0
    rc, out, err = run(capsys, "export", ranks_dir, "--to", "safetensors", st0)
    assert rc == 0, err
    assert "rank 0 of 2" in out
    assert_same(safetensors_torch.load_file(st0), want[0])

    rc, out, err = run(capsys, "export", ranks_dir, "--to", "torch", str(tmp_path / "x.pt"),
                       "--rank", "2")
    assert rc == 2 and "ranks 0..1" in err and not os.path.exists(tmp_path / "x.pt")


def test_export_fp32_of_a_checkpoint_not_written_through_deepspeed(run_dir, tmp_path, capsys):
    # (the DeepSpeed checkpoints' fp32 export: tests/integrations/test_deepspeed.py)
    out_file = tmp_path / "w.safetensors"
    rc, out, err = run(capsys, "export", run_dir, "--to", "fp32", str(out_file))
    assert rc == 1 and "gockpt.integrations.deepspeed" in err and "--to safetensors" in err
    assert not out_file.exists()


# ---------------------------------------------------------------- --to deepspeed, its usage
# (the export of real DeepSpeed checkpoints, loaded by DeepSpeed without gockpt:
# tests/integrations/test_deepspeed_export.py)

BF16_ZERO1 = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "bf16": {"enabled": True}}


@pytest.fixture
def ds_config(tmp_path):
    def write(cfg=BF16_ZERO1, text=None):
        path = tmp_path / "ds_config.json"
        path.write_text(text if text is not None else json.dumps(cfg))
        return str(path)
    return write


def test_export_deepspeed_needs_a_directory_and_a_readable_config(run_dir, tmp_path, ds_config,
                                                                  capsys):
    out = tmp_path / "ds"
    some_file = tmp_path / "f"
    some_file.write_text("keep")
    rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(some_file),
                     "--ds-config", ds_config())
    assert rc == 2 and "not a directory" in err and some_file.read_text() == "keep"
    out.mkdir()
    (out / "mine").write_text("keep")
    rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(out),
                     "--ds-config", ds_config())
    assert rc == 2 and "--force" in err and os.listdir(out) == ["mine"]
    rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(tmp_path / "a"),
                     "--ds-config", ds_config(), "--rank", "1")
    assert rc == 2 and "every rank's part" in err
    rc, _, err = run(capsys, "export", run_dir, "--to", "torch", str(tmp_path / "b.pt"),
                     "--ds-config", ds_config())
    assert rc == 2 and "--ds-config is for --to deepspeed" in err
    rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(tmp_path / "no" / "c"),
                     "--ds-config", ds_config())
    assert rc == 2 and "does not exist" in err
    rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(tmp_path / "d"),
                     "--ds-config", str(tmp_path / "missing.json"))
    assert rc == 2 and "missing.json" in err and not (tmp_path / "d").exists()


@pytest.mark.parametrize("cfg,text,match", [
    (None, "{not json", "not JSON"),
    (None, "[1, 2]", "not a JSON object"),
    ({**BF16_ZERO1, "zero_optimization": {"stage": 3}}, None, "ZeRO stage 3"),
    ({**BF16_ZERO1, "zero_optimization": {"stage": "auto"}}, None, "not 'auto'"),
    ({**BF16_ZERO1, "zero_optimization": {"stage": 1, "elastic_checkpoint": True}}, None,
     "elastic_checkpoint"),
    ({"zero_optimization": {"stage": 1}}, None, "fp32 training"),
])
def test_export_deepspeed_refuses_a_config_it_cannot_honour(run_dir, tmp_path, ds_config,
                                                            capsys, cfg, text, match):
    path = ds_config(cfg, text)
    rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(tmp_path / "o"),
                     "--ds-config", path)
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_export_deepspeed_of_a_checkpoint_not_written_through_deepspeed(run_dir, tmp_path,
                                                                       ds_config, capsys):
    pytest.importorskip("deepspeed")
    out = tmp_path / "o"
    for config in ([], ["--ds-config", ds_config()]):  # --ds-config is optional
        rc, _, err = run(capsys, "export", run_dir, "--to", "deepspeed", str(out), *config)
        assert rc == 1 and "gockpt.integrations.deepspeed" in err and not out.exists(), err
