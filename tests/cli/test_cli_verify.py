"""Tests of `gockpt verify` (gockpt/cli/verify.py over gockpt.verify) on real checkpoints."""

import json
import os
import shutil

import pytest

from gockpt import storage

from tests._support.cli_helpers import flip_byte, run, part_dir


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
    assert f"2 of {len(storage.read_manifest(ckpt)['tensors'])} tensors bad" in out
    assert len(err.strip().splitlines()) == 1 and "verification failed" in err

    rc, out, _ = run(capsys, "verify", "--json", ckpt)
    r = json.loads(out)
    assert rc == 1 and r["ok"] is False
    assert sorted((b["tensor"], b["file"]) for b in r["bad"]) == [
        ("model/2.weight", "data.safetensors"), ("optim/1/exp_avg_sq", "data.safetensors")]
    assert r["tensors"] == len(storage.read_manifest(ckpt)["tensors"]) - 2  # the good ones


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
    assert "manifest" in out and "damaged: its bytes do not match its seal" in out


def test_verify_names_a_truncated_data_file_not_the_manifest(run_copy, capsys):
    ckpt = os.path.join(run_copy, "step-000000007")
    os.truncate(os.path.join(ckpt, "data.safetensors"), 1000)
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1
    assert f"{ckpt}': data.safetensors: truncated: 1000 bytes, where the manifest places " \
        "bytes" in out
    assert "manifest.json" not in out and "unreadable" not in out, out


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
