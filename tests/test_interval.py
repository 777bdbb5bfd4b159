"""gockpt.interval, the library: the formulas against hand-computed values, the integer choice,
the validation of every number, and the metrics summary. The `gockpt-interval` tool is tested in
tests/cli/test_cli_interval.py."""

from __future__ import annotations

import json
import math

import pytest

from gockpt import interval as iv
from gockpt.core.errors import ConfigError


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


# ---------------------------------------------------------------------------- metrics summary

def _write_metrics(tmp_path, *lines):
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return str(tmp_path)


def test_summarise_metrics_median_p95_and_modes(tmp_path):
    # stalls 0.1, 0.4, 0.2, 0.3: median 0.25; p95 at position 0.95*3 = 2.85 -> 0.3 + 0.85*0.1
    # step times 0 (not measured), 2, 4, 3: median of 2, 3, 4 = 3
    recs = [{"blocked_s": 0.1, "step_time_s": 0.0, "mode": "sync"},
            {"blocked_s": 0.4, "step_time_s": 2.0, "mode": "gockpt-o"},
            {"blocked_s": 0.2, "step_time_s": 4.0, "mode": "sync"},
            {"blocked_s": 0.3, "step_time_s": 3.0}]
    d = _write_metrics(tmp_path, *map(json.dumps, recs), "")
    m = iv.summarise_metrics(d)
    assert m.checkpoints == 4 and m.mode == "sync+gockpt-o"
    assert m.stall_median_s == pytest.approx(0.25)
    assert m.stall_p95_s == pytest.approx(0.385)
    assert m.step_time_median_s == 3.0
    assert m.path == str(tmp_path / "metrics.jsonl")


def test_a_checkpoint_of_several_ranks_counts_once_with_its_slowest_rank(tmp_path):
    def rec(rank, blocked, final):
        return json.dumps({"blocked_s": blocked, "step_time_s": 1.0, "rank": rank,
                           "world_size": 2, "start_step": final - 1, "final_step": final})
    d = _write_metrics(tmp_path, rec(0, 0.1, 4), rec(1, 0.3, 4), rec(0, 0.2, 8),
                       rec(1, 0.1, 8), rec(0, 0.5, 8))  # the last: step 8 checkpointed again
    m = iv.summarise_metrics(d)
    assert m.checkpoints == 3
    assert m.stall_median_s == pytest.approx(0.3)  # of 0.3, 0.2, 0.5


def test_summarise_metrics_without_a_measured_step_time(tmp_path):
    d = _write_metrics(tmp_path, json.dumps({"blocked_s": 0.5}))
    m = iv.summarise_metrics(d)
    assert m.step_time_median_s is None and m.mode == "measured" and m.stall_median_s == 0.5


@pytest.mark.parametrize("lines, needle", [
    ((), "does not exist"),
    (("",), "is empty"),
    (('{"blocked_s": 1}', "{oops"), "metrics.jsonl:2: not valid JSON"),
    (("[1]",), "metrics.jsonl:1: expected a JSON object"),
    (('{"step_time_s": 1}',), "record 1 has no 'blocked_s'"),
    (('{"blocked_s": -1}',), "record 1 blocked_s must be >= 0"),
])
def test_summarise_metrics_errors(tmp_path, lines, needle):
    d = _write_metrics(tmp_path, *lines) if lines else str(tmp_path)
    with pytest.raises(ConfigError, match=needle):
        iv.summarise_metrics(d)
