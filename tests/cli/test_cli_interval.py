"""The `gockpt-interval` tool (gockpt.cli.interval, also `python -m gockpt.cli.interval`): its JSON
and table, --from-metrics on a metrics file written by a real checkpointing run, and the error
cases. The formulas themselves are tested in tests/test_interval.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import gockpt
from tests._support.cli_helpers import train
from gockpt import interval
from gockpt.cli import interval as iv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args):
    """``python -m gockpt.cli.interval ARGS`` in a subprocess: (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "gockpt.cli.interval", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def main_json(capsys, *args):
    """In-process ``main([... --json])``; asserts success and returns the parsed object."""
    assert iv.main([*map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------- CLI

def test_cli_json_case_a(capsys):
    d = main_json(capsys, "--mtbf", 3600, "--step-time", 0.5, "--stall", 2, "--load-time", 36)
    assert d["n_best_steps"] == 240 and isinstance(d["n_best_steps"], int)
    assert d["n_best"] == pytest.approx(240.0)
    assert d["interval_s"] == pytest.approx(120.0)
    assert d["waste_fraction"] == pytest.approx(13 / 300)
    assert d["overhead"] == pytest.approx(13 / 313)
    assert d["goodput"] == pytest.approx(300 / 313)
    assert d["young_s"] == pytest.approx(120.0)
    assert d["daly_s"] == pytest.approx(118 + 2 / 3 + 1 / 270)
    assert d["failure_rate_per_s"] == pytest.approx(1 / 3600)
    assert [s["name"] for s in d["schemes"]] == ["measured"]


def test_daly_branch_flagged_by_cli(capsys):
    # stall 100 s >= 2 * MTBF 10 s: Daly gives 10 s and the table warns.
    assert iv.main(["--mtbf", "10", "--step-time", "1", "--stall", "100"]) == 0
    out = capsys.readouterr().out
    assert "stall >= 2 x MTBF" in out
    d = main_json(capsys, "--mtbf", "10", "--step-time", "1", "--stall", "100")
    assert d["daly_s"] == 10.0 and d["first_order_reliable"] is False


def test_cli_failure_rate_equals_mtbf(capsys):
    a = main_json(capsys, "--mtbf", 3600, "--step-time", 0.5, "--stall", 2)
    b = main_json(capsys, "--failure-rate", 1 / 3600, "--step-time", 0.5, "--stall", 2)
    for key in ("n_best_steps", "interval_s", "waste_fraction", "young_s", "daly_s"):
        assert b[key] == pytest.approx(a[key]), key


def test_cli_compare_rows(capsys):
    # T = 0.5, M = 3600: N* = sqrt(2 d * 3600 / 0.25) = sqrt(28800 d)
    # sync d=8: sqrt(230400) = 480; async d=2: 240; gockpt-o d=0.5: sqrt(14400) = 120
    d = main_json(capsys, "--mtbf", 3600, "--step-time", 0.5,
                  "--compare", "sync=8", "async=2", "gockpt-o=0.5")
    rows = {s["name"]: s for s in d["schemes"]}
    assert list(rows) == ["sync", "async", "gockpt-o"]
    assert [rows[k]["n_best_steps"] for k in rows] == [480, 240, 120]
    # A smaller stall wastes less: P* = sqrt(2 d / M) = sqrt(d/1800): 1/15, 1/30, 1/60
    assert [rows[k]["waste_fraction"] for k in rows] == pytest.approx([1 / 15, 1 / 30, 1 / 60])
    assert d["n_best_steps"] == 480  # top level mirrors the first row


def test_cli_table_aligned_with_units(capsys):
    assert iv.main(["--mtbf", "3600", "--step-time", "0.5", "--stall", "2",
                    "--compare", "sync=8", "gockpt-o=0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("scheme"))
    table = out[start:start + 5]  # header, units, 3 rows
    assert "[s]" in table[1] and "[steps]" in table[1] and "[%]" in table[1]
    assert [line.split()[0] for line in table[2:]] == ["measured", "sync", "gockpt-o"]
    # Right-aligned numeric columns: every line of the table ends at the same column.
    assert len({len(line) for line in table}) == 1
    assert table[2].split()[3] == "240"  # "N used" of the measured row


def test_cli_module_and_console_script(tmp_path):
    rc, out, err = run_cli("--mtbf", 3600, "--step-time", 0.5, "--stall", 2, "--json")
    assert rc == 0 and err == "" and json.loads(out)["n_best_steps"] == 240
    script = os.path.join(os.path.dirname(sys.executable), "gockpt-interval")
    if not os.path.exists(script):
        pytest.skip("gockpt-interval console script not installed in this environment")
    proc = subprocess.run([script, "--mtbf", "3600", "--step-time", "0.5", "--stall", "2",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout)["n_best_steps"] == 240


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "waste.png"
    assert iv.main(["--mtbf", "3600", "--step-time", "0.5", "--compare", "sync=8", "async=2",
                    "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- --from-metrics

@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A checkpoint directory written by a short real training run (async, every 3 steps)."""
    path = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    train(path, model, torch.optim.AdamW(model.parameters()), steps=10, inputs=64, mode="async",
          overlap_steps=None, at=(3, 6, 9))
    return str(path)


def test_from_metrics_real_run(real_run):
    records = gockpt.metrics.read(real_run)
    assert len(records) == 3  # checkpoints at steps 3, 6, 9
    # Recompute independently of gockpt.interval: numpy median and percentile.
    stall = float(np.median([r["blocked_s"] for r in records]))
    p95 = float(np.percentile([r["blocked_s"] for r in records], 95))
    step = float(np.median([r["step_time_s"] for r in records if r["step_time_s"] > 0]))
    assert stall > 0 and step > 0

    rc, out, err = run_cli("--from-metrics", real_run, "--mtbf", 3600, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert [s["name"] for s in d["schemes"]] == ["async"]  # one row, named after the mode
    assert d["stall_s"] == pytest.approx(stall, rel=1e-12)
    assert d["step_time_s"] == pytest.approx(step, rel=1e-12)
    assert d["metrics"]["stall_p95_s"] == pytest.approx(p95, rel=1e-12)
    assert d["metrics"]["checkpoints"] == 3
    assert d["metrics"]["n_best_steps_at_p95"] == interval.auto_interval(p95, step, 3600.0)
    # N* = sqrt(2 d M) / T
    assert d["n_best"] == pytest.approx(math.sqrt(2 * stall * 3600) / step, rel=1e-9)
    assert d["n_best_steps"] == interval.auto_interval(stall, step, 3600.0)
    assert d["young_s"] == pytest.approx(math.sqrt(2 * stall * 3600), rel=1e-9)
    n = d["n_best_steps"]
    assert d["waste_fraction"] == pytest.approx(stall / (n * step) + n * step / 7200, rel=1e-9)


def test_from_metrics_with_compare_and_overrides(real_run, capsys):
    d = main_json(capsys, "--from-metrics", real_run, "--mtbf", 3600, "--step-time", 0.5,
                  "--compare", "sync=8")
    # --step-time given explicitly wins over the file; the measured row comes first.
    assert d["step_time_s"] == 0.5
    assert [s["name"] for s in d["schemes"]] == ["async", "sync"]
    assert d["schemes"][1]["n_best_steps"] == 480  # as in test_cli_compare_rows


def test_from_metrics_table(real_run, capsys):
    assert iv.main(["--from-metrics", real_run, "--mtbf", "3600"]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoint(s), mode async" in out and "p95" in out


# ---------------------------------------------------------------------------- CLI errors

def _assert_one_line_error(rc, out, err, needle):
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gockpt-interval: error:"), err
    assert needle in lines[0], err


@pytest.mark.parametrize("args, needle", [
    (["--mtbf", "0", "--step-time", "1", "--stall", "1"], "--mtbf must be > 0"),
    (["--mtbf", "-5", "--step-time", "1", "--stall", "1"], "--mtbf must be > 0"),
    (["--failure-rate", "0", "--step-time", "1", "--stall", "1"], "--failure-rate must be > 0"),
    (["--mtbf", "100", "--step-time", "0", "--stall", "1"], "step time must be > 0"),
    (["--mtbf", "100", "--step-time", "1", "--stall", "-1"], "stall must be > 0"),
    (["--mtbf", "100", "--step-time", "1", "--stall", "nan"], "stall must be finite"),
    (["--mtbf", "100", "--step-time", "1", "--stall", "1", "--load-time", "-1"],
     "load time must be >= 0"),
    (["--step-time", "1", "--stall", "1"], "give --mtbf"),
    (["--mtbf", "100", "--stall", "1"], "give --step-time"),
    (["--mtbf", "100", "--step-time", "1"], "give --stall"),
    (["--mtbf", "100", "--step-time", "1", "--compare", "sync"], "NAME=STALL"),
    (["--mtbf", "100", "--step-time", "1", "--compare", "sync=fast"], "must be a number"),
    (["--mtbf", "100", "--step-time", "1", "--compare", "sync=0"], "must be > 0"),
])
def test_cli_errors(args, needle, capsys):
    rc = iv.main(args)
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, needle)


def test_cli_error_exit_status_in_subprocess():
    rc, out, err = run_cli("--mtbf", 0, "--step-time", 1, "--stall", 1)
    _assert_one_line_error(rc, out, err, "--mtbf must be > 0")


def test_cli_argparse_errors_exit_2(capsys):
    # Both rate options, and a non-number: argparse's own errors, also status 2.
    assert iv.main(["--mtbf", "1", "--failure-rate", "1", "--step-time", "1",
                    "--stall", "1"]) == 2
    assert iv.main(["--mtbf", "soon", "--step-time", "1", "--stall", "1"]) == 2
    assert "error" in capsys.readouterr().err


def _metrics_dir(tmp_path, text):
    (tmp_path / "metrics.jsonl").write_text(text)
    return str(tmp_path)


def test_from_metrics_missing_file(tmp_path, capsys):
    rc = iv.main(["--from-metrics", str(tmp_path), "--mtbf", "3600"])
    c = capsys.readouterr()
    _assert_one_line_error(rc, c.out, c.err, "does not exist")


def test_from_metrics_empty_file(tmp_path, capsys):
    rc = iv.main(["--from-metrics", _metrics_dir(tmp_path, "\n"), "--mtbf", "3600"])
    c = capsys.readouterr()
    _assert_one_line_error(rc, c.out, c.err, "is empty")


def test_from_metrics_step_time_not_measured(tmp_path, capsys):
    line = json.dumps({"blocked_s": 0.5, "step_time_s": 0.0, "mode": "sync",
                       "start_step": 1, "final_step": 1})
    d = _metrics_dir(tmp_path, line + "\n")
    rc = iv.main(["--from-metrics", d, "--mtbf", "3600"])
    c = capsys.readouterr()
    _assert_one_line_error(rc, c.out, c.err, "no record has a measured step_time_s")
    # ... and the suggested fix works: T = 0.5, d = 0.5 -> N* = sqrt(2*0.5*3600)/0.5 = 120
    out = main_json(capsys, "--from-metrics", d, "--mtbf", 3600, "--step-time", 0.5)
    assert out["n_best_steps"] == 120 and out["name"] == "sync"


def test_from_metrics_malformed_line(tmp_path, capsys):
    good = json.dumps({"blocked_s": 0.5, "step_time_s": 0.1, "mode": "sync"})
    rc = iv.main(["--from-metrics", _metrics_dir(tmp_path, good + "\n{oops\n"),
                  "--mtbf", "3600"])
    c = capsys.readouterr()
    _assert_one_line_error(rc, c.out, c.err, "metrics.jsonl:2: not valid JSON")


def test_from_metrics_zero_stall(tmp_path, capsys):
    line = json.dumps({"blocked_s": 0.0, "step_time_s": 0.1, "mode": "gockpt-o"})
    rc = iv.main(["--from-metrics", _metrics_dir(tmp_path, line + "\n"), "--mtbf", "3600"])
    c = capsys.readouterr()
    _assert_one_line_error(rc, c.out, c.err, "stall must be > 0")
