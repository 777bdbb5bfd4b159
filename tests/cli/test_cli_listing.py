"""Tests of `gockpt list` and `gockpt clean` (gockpt/cli/listing.py)."""

import json
import os

from gockpt import storage

from tests._support.cli_helpers import run


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
