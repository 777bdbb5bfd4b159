"""Tests of the `gockpt` console tool (gockpt/cli.py) on real checkpoints."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.cli import main

safetensors_torch = pytest.importorskip("safetensors.torch")


def make_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters())


def train(directory, model, opt, steps=8, inputs=16):
    ck = gockpt.Checkpointer(model, opt, str(directory), mode="gockpt-o", overlap_steps=2,
                             interval=3)
    for step in range(steps):
        loss = model(torch.randn(8, inputs)).pow(2).mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)
    ck.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with checkpoints of steps 4 and 7 (latest). Do not modify: copy it."""
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("run")
    model, opt = make_model()
    train(d, model, opt)
    assert storage.list_checkpoints(str(d)) == ["step-000000004", "step-000000007"]
    return str(d)


@pytest.fixture
def run_copy(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return str(dst)


def flip_byte(ckpt, tensor):
    """Flip one bit in the middle of ``tensor``'s bytes, found through the manifest."""
    e = storage.read_manifest(ckpt)["tensors"][tensor]
    with open(os.path.join(ckpt, e["file"]), "r+b") as f:
        f.seek(e["offset"] + e["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def bitwise_equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return (isinstance(b, dict) and set(a) == set(b)
                and all(bitwise_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------------- inspect


def test_inspect_run_dir_shows_latest(run_dir, capsys):
    rc, out, err = run(capsys, "inspect", run_dir)
    assert rc == 0, err
    assert os.path.join(run_dir, "step-000000007") in out.splitlines()[0]
    assert "latest of" in out.splitlines()[0]
    lines = {}
    for line in out.splitlines():
        if line.strip():
            lines.setdefault(line.split(None, 1)[0], line)  # the header block comes first
    assert lines["step"].split()[1] == "7"
    assert "gockpt-o" in lines["mode"] and "K=2" in lines["mode"]
    assert lines["ranks"].split()[1] == "1"
    assert "AdamW" in lines["optimizer"]
    assert "3 buffers" in lines["model"] and "6 parameters" in lines["model"]
    assert "timings" in out and "time to durable" in out
    # the tensor table: every tensor, with its shape and what it holds
    manifest = storage.read_manifest(os.path.join(run_dir, "step-000000007"))
    rows = [line.split() for line in out.splitlines() if line.startswith("  model/")
            or line.startswith("  optim/") or line.startswith("  small/")]
    assert [r[0] for r in rows] == list(manifest["tensors"])
    row = next(line for line in out.splitlines() if line.strip().startswith("small/model/0 "))
    assert "buffer 1.running_mean" in row
    row = next(line for line in out.splitlines() if line.strip().startswith("model/0.weight "))
    assert "[16, 16]" in row and "1.0 KiB" in row


def test_inspect_checkpoint_dir_json(run_dir, capsys):
    path = os.path.join(run_dir, "step-000000004")
    rc, out, err = run(capsys, "inspect", "--json", path)
    assert rc == 0, err
    s = json.loads(out)
    manifest = storage.read_manifest(path)
    assert s["step"] == 4 and s["mode"] == "gockpt-o" and s["run_dir"] is None
    assert s["path"] == os.path.abspath(path)
    assert s["tensor_bytes"] == sum(e["nbytes"] for e in manifest["tensors"].values())
    assert s["tensors"]["model/0.weight"]["shape"] == [16, 16]
    assert s["tensors"]["optim/0/exp_avg"]["holds"].endswith("of 0.weight")
    assert s["model"]["params"] == 6
    assert s["model"]["buffers"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert s["metrics"]["final_step"] == 4
    assert s["disk_bytes"] >= s["tensor_bytes"]


# ---------------------------------------------------------------------------------- verify


def test_verify_ok(run_dir, capsys):
    rc, out, err = run(capsys, "verify", run_dir)
    n = len(storage.read_manifest(os.path.join(run_dir, "step-000000007"))["tensors"])
    assert rc == 0, err
    assert out.startswith("OK") and f"{n} tensors" in out and "step-000000007" in out
    assert err == ""


def test_verify_names_every_flipped_tensor(run_copy, capsys):
    ckpt = os.path.join(run_copy, "step-000000007")
    flip_byte(ckpt, "model/2.weight")
    flip_byte(ckpt, "optim/1/exp_avg_sq")
    rc, out, err = run(capsys, "verify", run_copy)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    assert len(bad) == 2  # does not stop at the first, reports no good tensor
    # in manifest order, which follows the writer's data layout: either may come first
    named = sorted(next(t for t in ("'model/2.weight'", "'optim/1/exp_avg_sq'") if t in line)
                   for line in bad)
    assert named == ["'model/2.weight'", "'optim/1/exp_avg_sq'"]
    assert all("data.safetensors" in line for line in bad)
    assert "2 of 29 tensors bad" in out
    assert len(err.strip().splitlines()) == 1 and "verification failed" in err

    rc, out, _ = run(capsys, "verify", "--json", ckpt)
    r = json.loads(out)
    assert rc == 1 and r["ok"] is False
    assert sorted((b["tensor"], b["file"]) for b in r["bad"]) == [
        ("model/2.weight", "data.safetensors"), ("optim/1/exp_avg_sq", "data.safetensors")]
    assert r["tensors"] == 27


def test_verify_all_checks_older_checkpoints(run_copy, capsys):
    flip_byte(os.path.join(run_copy, "step-000000004"), "small/model/0")
    rc, _, _ = run(capsys, "verify", run_copy)  # latest is fine
    assert rc == 0
    rc, out, _ = run(capsys, "verify", "--all", "--json", run_copy)
    results = json.loads(out)
    assert rc == 1
    assert [(os.path.basename(r["path"]), r["ok"]) for r in results] == [
        ("step-000000004", False), ("step-000000007", True)]
    assert [b["tensor"] for b in results[0]["bad"]] == ["small/model/0"]


def test_verify_corrupt_manifest(run_copy, capsys):
    ckpt = os.path.join(run_copy, "step-000000007")
    with open(os.path.join(ckpt, storage.MANIFEST_FILE), "w") as f:
        f.write("{not json")
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1
    assert "manifest" in out and "not JSON" in out


# ---------------------------------------------------------------------------------- export


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
    assert bitwise_equal(model.state_dict(), ref_model.state_dict())
    assert bitwise_equal(opt.state_dict(), ref_opt.state_dict())
    # and the optimizer keeps working identically after loading
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    assert bitwise_equal(model.state_dict(), ref_model.state_dict())


def test_export_safetensors_round_trips_bitwise(run_dir, tmp_path, capsys):
    out_file = str(tmp_path / "model.safetensors")
    ckpt = os.path.join(run_dir, "step-000000004")
    rc, out, err = run(capsys, "export", ckpt, "--to", "safetensors", out_file)
    assert rc == 0, err
    sd = safetensors_torch.load_file(out_file)
    ref_model, _ = make_model()
    gockpt.load(run_dir, ref_model, tag="step-000000004", restore_rng=False)
    assert bitwise_equal(sd, dict(ref_model.state_dict()))
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
    assert bitwise_equal(fresh.state_dict(), model.state_dict())

    rc, _, err = run(capsys, "export", str(tmp_path / "run"), "--to", "torch", pt)
    assert rc == 0, err
    obj = torch.load(pt, weights_only=True)
    assert obj["model"]["b.weight"] is obj["model"]["a.weight"]  # tied, as torch saves it
    fresh, fresh_opt = Tied(), None
    fresh.load_state_dict(obj["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh_opt.load_state_dict(obj["optimizer"])
    assert bitwise_equal(fresh.state_dict(), model.state_dict())
    assert bitwise_equal(fresh_opt.state_dict(), opt.state_dict())


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


# ---------------------------------------------------------------------------------- list


def test_list_marks_latest_and_incomplete(run_copy, capsys):
    leftover = ".tmp-step-000000009-99999999-abcd"
    os.mkdir(os.path.join(run_copy, leftover))
    rc, out, err = run(capsys, "list", run_copy)
    assert rc == 0, err
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line
            for line in out.splitlines()[1:] if line.strip() and not line[0].isdigit()}
    assert rows["step-000000007"].startswith("*") and "latest" in rows["step-000000007"]
    assert not rows["step-000000004"].startswith("*") and "latest" not in rows["step-000000004"]
    assert rows["step-000000004"].split()[1] == "4"
    assert "incomplete" in rows[leftover]
    assert "1 incomplete leftover" in out

    rc, out, _ = run(capsys, "list", "--json", run_copy)
    listed = {r["name"]: r for r in json.loads(out)}
    assert rc == 0
    assert listed["step-000000007"]["latest"] is True and listed["step-000000007"]["step"] == 7
    assert listed["step-000000004"]["latest"] is False
    assert listed[leftover]["status"] == "incomplete"
    assert listed["step-000000004"]["bytes"] > 0 and listed["step-000000004"]["date"]


def test_list_without_latest_pointer_marks_newest(run_copy, capsys):
    os.unlink(os.path.join(run_copy, storage.LATEST_FILE))
    rc, out, err = run(capsys, "list", run_copy)
    assert rc == 0, err
    line = next(li for li in out.splitlines() if "step-000000007" in li)
    assert line.startswith("*") and "missing or stale" in line


def test_clean_removes_dead_leftovers(run_copy, capsys):
    leftover = os.path.join(run_copy, ".tmp-step-000000009-99999999-abcd")
    os.mkdir(leftover)
    rc, out, _ = run(capsys, "clean", run_copy)
    assert rc == 0 and not os.path.exists(leftover) and "1 leftover(s) removed" in out
    assert storage.list_checkpoints(run_copy) == ["step-000000004", "step-000000007"]


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("cmd", [["inspect"], ["verify"], ["list"],
                                 ["export", "--to", "torch", "OUT"]])
def test_missing_path_is_exit_2_with_one_line(cmd, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    argv = [cmd[0], missing] + cmd[1:]
    if cmd[0] == "export":
        argv = ["export", missing, "--to", "torch", str(tmp_path / "o.pt")]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gockpt: error:") and missing in err


def test_not_a_checkpoint_is_exit_2(tmp_path, capsys):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "file.txt").write_text("hello")
    rc, _, err = run(capsys, "inspect", str(tmp_path / "stuff"))
    assert rc == 2 and "neither a gockpt checkpoint nor a run directory" in err
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "verify", str(tmp_path / "stuff" / "file.txt"))
    assert rc == 2 and "not a directory" in err


def test_corrupt_manifest_is_exit_1(run_copy, capsys):
    with open(os.path.join(run_copy, "step-000000007", storage.MANIFEST_FILE), "w") as f:
        json.dump({"format": storage.FORMAT, "format_version": storage.FORMAT_VERSION,
                   "tensors": 3}, f)
    rc, out, err = run(capsys, "inspect", run_copy)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "'tensors' is missing or not an object" in err
    rc, out, _ = run(capsys, "list", run_copy)  # list still works and flags it
    assert rc == 0
    assert "CORRUPT" in next(li for li in out.splitlines() if "step-000000007" in li)


def test_usage_errors_are_exit_2(capsys):
    assert run(capsys)[0] == 2
    rc, _, err = run(capsys, "export", "somewhere", "out.pt")  # --to missing
    assert rc == 2 and "--to" in err
    rc, _, err = run(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err


# ---------------------------------------------------------------------------------- ranks


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    """A run directory holding one checkpoint (step 4) written by two real ranks (gloo
    subprocesses, as tests/test_ranks.py starts them). Do not modify: copy it."""
    from test_ranks import run_ranks
    d = tmp_path_factory.mktemp("ranks")
    run_ranks(d, "ok")
    assert storage.list_checkpoints(str(d)) == ["step-000000004"]
    return str(d)


@pytest.fixture
def ranks_copy(ranks_dir, tmp_path):
    dst = tmp_path / "ranks"
    shutil.copytree(ranks_dir, dst)
    return str(dst)


def part_dir(run, rank):
    return os.path.join(run, "step-000000004", f"rank-{rank:05d}")


def test_ranks_inspect_shows_parts_sizes_and_timings(ranks_dir, capsys):
    ckpt = os.path.join(ranks_dir, "step-000000004")
    parts = [storage.read_manifest(part_dir(ranks_dir, r)) for r in range(2)]
    rc, out, err = run(capsys, "inspect", ranks_dir)
    assert rc == 0, err
    lines = out.splitlines()
    head = {}
    for line in lines:
        if line.strip():
            head.setdefault(line.split(None, 1)[0], line)
    assert head["step"].split()[1] == "4"
    assert head["ranks"].split()[1] == "2" and "rank-00000, rank-00001" in head["ranks"]
    total = sum(len(m["tensors"]) for m in parts)
    assert f"in {total} tensors, summed over 2 part(s)" in head["size"]
    rows = {li.split()[1]: li.split() for li in lines if li.strip().startswith(("0  rank-",
                                                                                  "1  rank-"))}
    assert set(rows) == {"rank-00000", "rank-00001"}
    for r, m in enumerate(parts):
        row = rows[f"rank-{r:05d}"]
        assert row[0] == str(r) and row[2] == "4" and row[3] == str(len(m["tensors"]))
        assert row[-1] == "ok"
    assert "timings (per rank)" in out
    hdr = next(li for li in lines if "rank 0" in li and "rank 1" in li)
    assert hdr.split() == ["rank", "0", "rank", "1", "max"]
    durable = next(li for li in lines if li.strip().startswith("time to durable")).split()
    want = [parts[r]["metrics"]["time_to_durable_s"] for r in range(2)]
    assert durable[3:] == [f"{want[0]:.4f}s", f"{want[1]:.4f}s", f"{max(want):.4f}s"]
    assert "--rank R" in out

    rc, out, err = run(capsys, "inspect", "--json", ckpt)
    assert rc == 0, err
    s = json.loads(out)
    assert s["step"] == 4 and s["ranks"]["world_size"] == 2
    assert [(p["rank"], p["name"], p["tensors"], p["ok"]) for p in s["parts"]] == [
        (r, f"rank-{r:05d}", len(m["tensors"]), True) for r, m in enumerate(parts)]
    assert s["tensor_bytes"] == sum(e["nbytes"] for m in parts for e in m["tensors"].values())
    assert s["tensor_count"] == total
    assert [p["metrics"]["final_step"] for p in s["parts"]] == [4, 4]
    assert s["disk_bytes"] >= s["tensor_bytes"]


def test_ranks_inspect_one_part(ranks_dir, capsys):
    manifest = storage.read_manifest(part_dir(ranks_dir, 1))
    rc, out, err = run(capsys, "inspect", ranks_dir, "--rank", "1")
    assert rc == 0, err
    assert out.splitlines()[0].split()[1] == part_dir(ranks_dir, 1)
    assert "part         rank 1 of 2 (rank-00001)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  model/")
            or line.startswith("  optim/") or line.startswith("  small/")]
    assert [r[0] for r in rows] == list(manifest["tensors"])
    assert "time to durable" in out

    rc, out, err = run(capsys, "inspect", "--json", "--rank", "1", ranks_dir)
    assert rc == 0, err
    s = json.loads(out)
    assert s["part_of"]["rank"] == 1 and s["part_of"]["world_size"] == 2
    assert set(s["tensors"]) == set(manifest["tensors"])
    assert s["ranks"] == {"rank": 1, "world_size": 2}

    rc, out, err = run(capsys, "inspect", ranks_dir, "--rank", "2")
    assert rc == 2 and out == "" and "ranks 0..1" in err and err.count("\n") == 1


def test_ranks_verify_ok(ranks_dir, capsys):
    n = sum(len(storage.read_manifest(part_dir(ranks_dir, r))["tensors"]) for r in range(2))
    rc, out, err = run(capsys, "verify", ranks_dir)
    assert rc == 0, err
    assert out.startswith("OK") and "2 ranks" in out and f"{n} tensors" in out
    rc, out, _ = run(capsys, "verify", "--json", ranks_dir)
    r = json.loads(out)
    assert rc == 0 and r["ok"] and r["world_size"] == 2 and r["tensors"] == n
    assert [(p["name"], p["ok"]) for p in r["parts"]] == [("rank-00000", True),
                                                          ("rank-00001", True)]


def test_ranks_verify_names_the_part_of_a_flipped_tensor(ranks_copy, capsys):
    part = part_dir(ranks_copy, 1)
    flip_byte(part, "model/hidden.weight")
    rc, out, err = run(capsys, "verify", ranks_copy)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    assert len(bad) == 1
    assert "rank-00001/data.safetensors" in bad[0] and "'model/hidden.weight'" in bad[0]
    assert "1 of" in out and "(rank-00001 1)" in out
    assert len(err.strip().splitlines()) == 1 and "verification failed" in err

    rc, out, _ = run(capsys, "verify", "--json", ranks_copy)
    r = json.loads(out)
    assert rc == 1 and r["ok"] is False and r["missing"] == []
    assert [(b["tensor"], b["file"], b["rank"]) for b in r["bad"]] == [
        ("model/hidden.weight", "rank-00001/data.safetensors", 1)]
    assert [(p["name"], p["ok"], p["bad"]) for p in r["parts"]] == [
        ("rank-00000", True, 0), ("rank-00001", False, 1)]

    # export of the damaged part fails and writes nothing; the intact part still exports
    out_file = os.path.join(ranks_copy, "r1.pt")
    rc, _, err = run(capsys, "export", ranks_copy, "--to", "torch", out_file, "--rank", "1")
    assert rc == 1 and "'model/hidden.weight'" in err and not os.path.exists(out_file)
    rc, _, err = run(capsys, "export", ranks_copy, "--to", "torch", out_file, "--rank", "0")
    assert rc == 0, err


@pytest.mark.parametrize("how", ["manifest", "directory"])
def test_ranks_verify_reports_a_missing_part(ranks_copy, capsys, how):
    part = part_dir(ranks_copy, 1)
    if how == "manifest":
        os.unlink(os.path.join(part, storage.MANIFEST_FILE))
    else:
        shutil.rmtree(part)
    rc, out, err = run(capsys, "verify", ranks_copy)
    assert rc == 1
    missing = [line for line in out.splitlines() if line.startswith("MISSING")]
    assert len(missing) == 1 and "part rank-00001 (rank 1 of 2)" in missing[0]
    assert ("manifest.json: missing" if how == "manifest" else "does not exist") in missing[0]
    assert "1 part(s) missing or unreadable" in out and "verification failed" in err

    rc, out, _ = run(capsys, "verify", "--json", ranks_copy)
    r = json.loads(out)
    assert rc == 1 and r["ok"] is False and r["bad"] == []
    assert [(m["rank"], m["part"]) for m in r["missing"]] == [(1, "rank-00001")]
    assert r["tensors"] == len(storage.read_manifest(part_dir(ranks_copy, 0))["tensors"])

    # inspect shows it (exit 1), list flags it, export of that rank fails
    rc, out, err = run(capsys, "inspect", ranks_copy)
    assert rc == 1 and "rank-00001" in err
    assert "MISSING" in next(li for li in out.splitlines() if li.strip().startswith("1  rank-"))
    rc, out, _ = run(capsys, "list", ranks_copy)
    assert rc == 0 and "MISSING PART" in out and "rank-00001" in out
    rc, _, err = run(capsys, "export", ranks_copy, "--to", "torch",
                     os.path.join(ranks_copy, "x.pt"), "--rank", "1")
    assert rc == 1 and "rank-00001" in err


def _part_model(part):
    """The model state of a part, read with gockpt.storage (name -> tensor)."""
    from gockpt.storage import tree
    manifest = storage.read_manifest(part)
    tensors = storage.read_tensors(part, manifest)
    sd = {name: tensors[t] for name, t in manifest["model"]["params"].items()}
    sd.update(tree.decode(manifest["small"]["model"], tensors))
    return sd


def test_ranks_export_selects_the_rank(ranks_dir, tmp_path, capsys):
    import harness
    want = [_part_model(part_dir(ranks_dir, r)) for r in range(2)]
    assert not bitwise_equal(want[0], want[1])  # every rank trained its own state

    pt = str(tmp_path / "r1.pt")
    rc, out, err = run(capsys, "export", ranks_dir, "--to", "torch", pt, "--rank", "1")
    assert rc == 0, err
    assert "rank 1 of 2" in out and "rank-00001" in out and "step 4" in out
    obj = torch.load(pt, weights_only=True)
    assert obj["step"] == 4 and obj["rank"] == 1 and obj["world_size"] == 2
    assert bitwise_equal(obj["model"], want[1])
    model, opt, sched = harness.build(seed=7)
    model.load_state_dict(obj["model"])  # strict
    opt.load_state_dict(obj["optimizer"])
    assert bitwise_equal(dict(model.state_dict()), want[1])

    st = str(tmp_path / "r1.safetensors")
    rc, out, err = run(capsys, "export", ranks_dir, "--to", "safetensors", st, "--rank", "1")
    assert rc == 0, err
    assert bitwise_equal(safetensors_torch.load_file(st), want[1])
    from safetensors import safe_open
    with safe_open(st, "pt") as f:
        assert f.metadata()["gockpt_rank"] == "1" and f.metadata()["gockpt_world_size"] == "2"

    st0 = str(tmp_path / "r0.safetensors")  # default: rank 0
    rc, out, err = run(capsys, "export", ranks_dir, "--to", "safetensors", st0)
    assert rc == 0, err
    assert "rank 0 of 2" in out
    assert bitwise_equal(safetensors_torch.load_file(st0), want[0])

    rc, out, err = run(capsys, "export", ranks_dir, "--to", "torch", str(tmp_path / "x.pt"),
                       "--rank", "2")
    assert rc == 2 and "ranks 0..1" in err and not os.path.exists(tmp_path / "x.pt")


def test_rank_option_on_a_single_rank_checkpoint(run_dir, tmp_path, capsys):
    rc, _, err = run(capsys, "inspect", run_dir, "--rank", "0")
    assert rc == 0, err
    rc, _, err = run(capsys, "inspect", run_dir, "--rank", "1")
    assert rc == 2 and "single process" in err
    rc, _, err = run(capsys, "export", run_dir, "--to", "torch", str(tmp_path / "x.pt"),
                     "--rank", "1")
    assert rc == 2 and "single process" in err


def test_ranks_list_shows_world_size(ranks_dir, run_dir, capsys):
    rc, out, err = run(capsys, "list", ranks_dir)
    assert rc == 0, err
    header = out.splitlines()[0].split()
    assert header[:4] == ["NAME", "STEP", "RANKS", "SIZE"]
    row = next(li for li in out.splitlines() if "step-000000004" in li).split()
    assert row[:4] == ["*", "step-000000004", "4", "2"] and "latest" in row
    rc, out, _ = run(capsys, "list", "--json", ranks_dir)
    assert [(r["name"], r["world_size"]) for r in json.loads(out)] == [("step-000000004", 2)]

    rc, out, _ = run(capsys, "list", run_dir)  # single-process checkpoints: 1
    row = next(li for li in out.splitlines() if "step-000000004" in li).split()
    assert row[:3] == ["step-000000004", "4", "1"]


# ---------------------------------------------------------------------------------- script


def test_installed_console_script(run_copy, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "gockpt")
    if not os.path.exists(exe):
        exe = shutil.which("gockpt")
    assert exe, "the gockpt console script is not installed (pip install -e .)"
    p = subprocess.run([exe, "list", run_copy], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "step-000000007" in p.stdout and "latest" in p.stdout
    flip_byte(os.path.join(run_copy, "step-000000007"), "model/0.weight")
    p = subprocess.run([exe, "verify", run_copy], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "'model/0.weight'" in p.stdout and "verification failed" in p.stderr
