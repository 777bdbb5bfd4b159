"""gockpt.interval: the formulas against hand-computed values, the CLI's JSON and table,
--from-metrics on a metrics file written by a real checkpointing run, and the error cases."""

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
from gockpt import interval as iv
from gockpt.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
    """``python -m gockpt.interval ARGS`` in a subprocess: (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "gockpt.interval", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def main_json(capsys, *args):
    """In-process ``main([... --json])``; asserts success and returns the parsed object."""
    assert iv.main([*map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------- formulas
# Reference case A: stall d = 2 s, MTBF M = 3600 s (p = 1/3600 /s), step T = 0.5 s,
# load R = 36 s.

def test_young_case_a():
    # sqrt(2 * 2 * 3600) = sqrt(14400) = 120 s
    assert iv.young_interval(2.0, 3600.0) == pytest.approx(120.0, rel=1e-12)


def test_optimal_steps_case_a():
    # N* = sqrt(2 d / (p T^2)) = sqrt(2 * 2 * 3600 / 0.25) = sqrt(57600) = 240 steps
    assert iv.optimal_steps(2.0, 0.5, 3600.0) == pytest.approx(240.0, rel=1e-12)


def test_waste_fraction_case_a():
    # P(240) = 2/(240*0.5) + 240*0.5/(2*3600) + 36/3600 = 1/60 + 1/60 + 1/100 = 13/300
    assert iv.waste_fraction(240, 2.0, 0.5, 3600.0, 36.0) == pytest.approx(13 / 300, rel=1e-12)
    # Without the load term: 1/60 + 1/60 = 1/30
    assert iv.waste_fraction(240, 2.0, 0.5, 3600.0) == pytest.approx(1 / 30, rel=1e-12)
    # Off the optimum it must be larger: P(120) = 2/60 + 60/7200 = 1/30 + 1/120 = 1/24
    assert iv.waste_fraction(120, 2.0, 0.5, 3600.0) == pytest.approx(1 / 24, rel=1e-12)


def test_daly_case_a():
    # d/(2M) = 2/7200 = 1/3600, sqrt = 1/60
    # 120 * (1 + (1/3)(1/60) + (1/9)(1/3600)) - 2 = 120 + 2/3 + 1/270 - 2 = 118.670370...
    assert iv.daly_interval(2.0, 3600.0) == pytest.approx(118 + 2 / 3 + 1 / 270, rel=1e-12)


def test_analyse_case_a():
    r = iv.analyse(2.0, 0.5, 3600.0, 36.0, name="x")
    assert r.n_best == pytest.approx(240.0)
    assert r.n_best_steps == 240 and isinstance(r.n_best_steps, int)
    assert r.interval_s == pytest.approx(120.0)                # 240 * 0.5
    assert r.waste_fraction == pytest.approx(13 / 300)         # see test_waste_fraction_case_a
    assert r.overhead == pytest.approx((13 / 300) / (313 / 300))   # P/(1+P) = 13/313
    assert r.goodput == pytest.approx(300 / 313)                 # 1/(1+P)
    assert r.overhead + r.goodput == pytest.approx(1.0)
    assert r.young_s == pytest.approx(120.0) and r.daly_s == pytest.approx(118.6703704)


@pytest.mark.parametrize("m_min, published_min, hand_min", [
    # Daly (2006), Figs. 3-5: delta = 5 min; the paper states tau_opt = 117, 57, 9.1 min.
    # M = 1440: sqrt(2*5*1440) = 120; x = 5/2880; 120*(1 + 0.041667/3 + 0.0017361/9) - 5
    #           = 120*1.0140818 - 5 = 116.6898
    (1440.0, 117.0, 116.6898),
    # M = 360:  sqrt(3600) = 60; x = 5/720; 60*(1 + 0.083333/3 + 0.0069444/9) - 5
    #           = 60*1.0285494 - 5 = 56.7130
    (360.0, 57.0, 56.7130),
    # M = 15:   sqrt(150) = 12.247449; x = 1/6; 12.247449*(1 + 0.408248/3 + 0.166667/9) - 5
    #           = 12.247449*1.1546012 - 5 = 9.1409
    (15.0, 9.1, 9.1409),
])
def test_daly_matches_published_examples(m_min, published_min, hand_min):
    got = iv.daly_interval(5.0, m_min)  # minutes in, minutes out: the formula is unit-free
    assert got == pytest.approx(hand_min, abs=1e-3)
    assert round(got, 1 if published_min < 10 else 0) == published_min


def test_daly_branch_stall_at_least_two_mtbf():
    # d = 2M exactly (100 = 2*50) takes the d >= 2M branch: tau = M = 50
    assert iv.daly_interval(100.0, 50.0) == 50.0
    # d = 6M: still M
    assert iv.daly_interval(300.0, 50.0) == 50.0
    # Just below, the series applies: x = 99/100; sqrt(2*99*50) = sqrt(9900) = 99.498744;
    # 99.498744*(1 + sqrt(0.99)/3 + 0.99/9) - 99 = 99.498744*1.4416625 - 99 = 44.4436
    assert iv.daly_interval(99.0, 50.0) == pytest.approx(44.4436, abs=1e-3)


def test_daly_branch_flagged_by_cli(capsys):
    # stall 100 s >= 2 * MTBF 10 s: Daly gives 10 s and the table warns.
    assert iv.main(["--mtbf", "10", "--step-time", "1", "--stall", "100"]) == 0
    out = capsys.readouterr().out
    assert "stall >= 2 x MTBF" in out
    d = main_json(capsys, "--mtbf", "10", "--step-time", "1", "--stall", "100")
    assert d["daly_s"] == 10.0 and d["first_order_reliable"] is False


def test_integer_choice_is_the_better_neighbour_not_round():
    # d = 0.5, T = 1, M = 6.1: N* = sqrt(2*0.5*6.1) = sqrt(6.1) = 2.4698, round() gives 2, but
    # P(2) = 0.5/2 + 2/12.2 = 0.25 + 0.163934 = 0.413934
    # P(3) = 0.5/3 + 3/12.2 = 0.166667 + 0.245902 = 0.412568  -> 3 wastes less
    assert iv.optimal_steps(0.5, 1.0, 6.1) == pytest.approx(math.sqrt(6.1))
    assert iv.best_integer_steps(0.5, 1.0, 6.1) == 3
    assert iv.auto_interval(0.5, 1.0, 6.1) == 3


def test_integer_at_least_one():
    # d = 0.01, T = 1, M = 10: N* = sqrt(2*0.01*10) = sqrt(0.2) = 0.447 -> 1 step
    assert iv.optimal_steps(0.01, 1.0, 10.0) == pytest.approx(math.sqrt(0.2))
    assert iv.auto_interval(0.01, 1.0, 10.0) == 1


@pytest.mark.parametrize("d, t, m", [(2.0, 0.5, 3600.0), (0.3, 0.07, 5000.0),
                                     (12.0, 1.3, 86400.0), (0.5, 1.0, 6.1)])
def test_integer_is_the_brute_force_minimiser(d, t, m):
    n = iv.best_integer_steps(d, t, m)
    scan = range(1, int(iv.optimal_steps(d, t, m)) * 3 + 3)
    assert n == min(scan, key=lambda k: iv.waste_fraction(k, d, t, m))


def test_waste_at_optimum_closed_form():
    # P(N*) = sqrt(2 p d) + p R; d = 3, M = 7200, R = 60, T = 0.25:
    # sqrt(2 * 3 / 7200) + 60/7200 = sqrt(1/1200) + 1/120 = 0.0288675 + 0.0083333 = 0.0372008
    n_star = iv.optimal_steps(3.0, 0.25, 7200.0)
    assert iv.waste_fraction(n_star, 3.0, 0.25, 7200.0, 60.0) == pytest.approx(0.0372008,
                                                                              abs=1e-7)


def test_auto_interval_returns_int_and_ignores_load_time():
    n = iv.auto_interval(2.0, 0.5, 3600.0)
    assert type(n) is int and n == 240
    # The load term is constant in N, so it cannot move the optimum.
    assert iv.auto_interval(2.0, 0.5, 3600.0, load_time_s=600.0) == 240


def test_percentile_linear_interpolation():
    # [1, 2, 3, 4], q = 0.95: position 0.95*3 = 2.85 -> 3 + 0.85*(4-3) = 3.85
    assert iv.percentile([4.0, 1.0, 3.0, 2.0], 0.95) == pytest.approx(3.85)
    assert iv.percentile([7.0], 0.95) == 7.0
    assert iv.percentile([1.0, 2.0, 3.0], 0.5) == 2.0


# ---------------------------------------------------------------------------- bad numbers

@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), None, "x", True])
@pytest.mark.parametrize("call", [
    lambda b: iv.young_interval(b, 3600.0),
    lambda b: iv.young_interval(2.0, b),
    lambda b: iv.daly_interval(b, 3600.0),
    lambda b: iv.daly_interval(2.0, b),
    lambda b: iv.optimal_steps(b, 0.5, 3600.0),
    lambda b: iv.optimal_steps(2.0, b, 3600.0),
    lambda b: iv.optimal_steps(2.0, 0.5, b),
    lambda b: iv.auto_interval(b, 0.5, 3600.0),
    lambda b: iv.auto_interval(2.0, b, 3600.0),
    lambda b: iv.auto_interval(2.0, 0.5, b),
    lambda b: iv.waste_fraction(b, 2.0, 0.5, 3600.0),
])
def test_library_rejects_non_positive(call, bad):
    with pytest.raises(ConfigError):
        call(bad)


def test_config_error_is_value_error_and_names_the_argument():
    with pytest.raises(ValueError, match="MTBF must be > 0"):
        iv.auto_interval(2.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="load time must be >= 0"):
        iv.auto_interval(2.0, 0.5, 3600.0, load_time_s=-1.0)
    # A zero load time is valid (restart cost unknown or negligible).
    assert iv.waste_fraction(240, 2.0, 0.5, 3600.0, 0.0) == pytest.approx(1 / 30)


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
    opt = torch.optim.AdamW(model.parameters())
    ck = gockpt.Checkpointer(model, opt, str(path), mode="async", interval=3)
    for step in range(10):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)
    ck.close()
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
    assert d["metrics"]["n_best_steps_at_p95"] == iv.auto_interval(p95, step, 3600.0)
    # N* = sqrt(2 d M) / T
    assert d["n_best"] == pytest.approx(math.sqrt(2 * stall * 3600) / step, rel=1e-9)
    assert d["n_best_steps"] == iv.auto_interval(stall, step, 3600.0)
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
