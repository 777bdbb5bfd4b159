"""Tests of `gockpt inspect` (gockpt/cli/inspect.py, summary.py) on real checkpoints."""

import json
import os

import gockpt
from gockpt import storage
from gockpt.cli.common import human

from tests._support.cli_helpers import run, part_dir


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
    # what the replay brought to F and what was copied at F, from metrics.jsonl
    met = gockpt.metrics.read(run_dir)[-1]
    assert met["replayed_bytes"] > 0 and met["copied_at_f_bytes"] > 0
    state = next(line for line in out.splitlines() if line.strip().startswith("state "))
    assert f"replayed {human(met['replayed_bytes'])}" in state
    assert f"copied at F {human(met['copied_at_f_bytes'])}" in state
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
