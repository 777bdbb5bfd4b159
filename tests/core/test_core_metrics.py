"""gockpt.core.metrics: what one checkpoint cost, one JSON line per checkpoint."""

from __future__ import annotations

import json
import os
import threading

import pytest

from gockpt.core import metrics
from gockpt.core.metrics import CheckpointMetrics


def test_add_blocked_sums_per_hook_and_in_total():
    m = CheckpointMetrics(4, 6, "gockpt-o", 3)
    m.add_blocked("update_begin", 0.5)
    m.add_blocked("save_checkpoint", 0.25)
    m.add_blocked("update_begin", 0.125)
    assert m.blocked_by_hook_s == {"update_begin": 0.625, "save_checkpoint": 0.25}
    assert m.blocked_s == 0.875


def test_to_dict_is_a_copy():
    m = CheckpointMetrics(4, 6, "gockpt-o", 3)
    m.add_blocked("update_begin", 1.0)
    d = m.to_dict()
    assert d["start_step"] == 4 and d["final_step"] == 6 and d["overlap_steps"] == 3
    d["blocked_by_hook_s"]["update_begin"] = 9.0
    assert m.blocked_by_hook_s["update_begin"] == 1.0


def test_append_then_read_round_trip(tmp_path):
    a, b = CheckpointMetrics(1, 2, "gockpt", 2), CheckpointMetrics(5, 5, "sync", 1)
    a.add_blocked("optimizer_step", 0.1)
    b.state_bytes = 123
    metrics.append(str(tmp_path), a)
    metrics.append(str(tmp_path), b)
    assert metrics.read(str(tmp_path)) == [a.to_dict(), b.to_dict()]
    text = open(os.path.join(tmp_path, "metrics.jsonl")).read()
    assert text.endswith("\n") and len(text.splitlines()) == 2
    assert all(json.loads(line) for line in text.splitlines())


def test_read_skips_blank_lines_and_needs_the_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        metrics.read(str(tmp_path))
    line = json.dumps(CheckpointMetrics(1, 1, "async", 1).to_dict())
    (tmp_path / "metrics.jsonl").write_text(f"{line}\n\n{line}\n")
    assert len(metrics.read(str(tmp_path))) == 2


@pytest.mark.parametrize("bad, message", [("{oops", r"metrics.jsonl:3: not valid JSON \(Expecting"),
                                          ("[1, 2]", "metrics.jsonl:3: expected a JSON object")])
def test_read_names_the_bad_line(tmp_path, bad, message):
    line = json.dumps(CheckpointMetrics(1, 1, "async", 1).to_dict())
    (tmp_path / "metrics.jsonl").write_text(f"{line}\n\n{bad}\n{line}\n")
    with pytest.raises(ValueError, match=message):
        metrics.read(str(tmp_path))


def test_concurrent_appends_give_whole_lines(tmp_path):
    start = threading.Barrier(4)

    def writer(i):
        start.wait()
        for n in range(25):
            m = CheckpointMetrics(i, n, "gockpt-o", 1)
            m.add_blocked(f"hook{i}", 0.5)
            metrics.append(str(tmp_path), m)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = metrics.read(str(tmp_path))  # every line parses
    assert sorted((r["start_step"], r["final_step"]) for r in records) == \
        [(i, n) for i in range(4) for n in range(25)]
