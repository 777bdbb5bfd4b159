"""The checkpoint interval that minimises wasted time, from the stall gockpt measured.

A cheaper checkpoint pays off by checkpointing more often, so that a failure loses less
work. This module turns a measured stall (the time one checkpoint blocks training) and
step time into the interval that minimises the expected waste, and shows what a smaller
stall buys. It is both a library (``auto_interval`` is what ``Checkpointer(interval="auto")``
calls) and the console script ``gockpt-interval`` (also ``python -m gockpt.interval``).

Model and formulas
------------------
Symbols: ``T_ckpt`` the stall of one checkpoint (s), ``T_step`` the time of one training
step (s), ``M`` the mean time between failures (MTBF, s), ``p = 1/M`` the failure rate
(1/s), ``T_load`` the time to restart from a checkpoint after a failure (s), ``N`` the
checkpoint interval in steps. Failures are a Poisson process.

Wasted time per unit of useful training time (the GoCkpt paper's per-step form of Young's
first-order cost model)::

    P(N) = T_ckpt / (N T_step)      stall, once every N steps
         + p N T_step / 2           rework: a failure loses half an interval on average
         + p T_load                 restart after each failure (independent of N)

Setting dP/dN = 0 gives the optimum::

    N* = sqrt(2 T_ckpt / (p T_step^2)),      P(N*) = sqrt(2 p T_ckpt) + p T_load

``N* T_step = sqrt(2 T_ckpt M)`` is exactly Young's interval. Because ``P`` is measured
against useful time, a run that does ``W`` seconds of useful work takes ``W (1 + P)``
seconds, so

* GPU-time overhead (fraction of all time that is wasted) = ``P / (1 + P)``
* goodput (fraction of all time that is useful training)  = ``1 / (1 + P)``.

``N`` must be a whole number of steps >= 1. ``P`` is convex in ``N``, so the best integer is
``floor(N*)`` or ``ceil(N*)``, whichever wastes less (plain rounding can pick the wrong one).

Shown alongside, in seconds of compute between checkpoints, with ``delta = T_ckpt``:

* Young (1974), first order:  ``T_young = sqrt(2 delta M)``
* Daly (2006), higher order:  ``T_daly = sqrt(2 delta M) [1 + (1/3) sqrt(delta/(2M))
  + (1/9) (delta/(2M))] - delta``  for ``delta < 2M``, and ``T_daly = M`` for
  ``delta >= 2M``.

The first-order model assumes ``T_ckpt << M``; when the two differ, trust Daly.

Sources
-------
* J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9):530-531, 1974. doi:10.1145/361147.361115
* J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", Future Generation Computer Systems 22(3):303-312, 2006.
  doi:10.1016/j.future.2004.11.016 (its worked examples, delta = 5 min with M = 24 h,
  6 h and 15 min, give 117, 57 and 9.1 min; tests/test_interval.py checks them).
* K. Zhang, Y. Chen, Z. Hu, W. Lin, J. Xu, W. Chen, "GoCkpt: Gradient-Assisted Multi-Step
  overlapped Checkpointing for Efficient LLM Training", arXiv:2511.07035, 2025: the
  per-step wasted-time proportion ``P(N)`` and its optimum ``N*`` above.

See docs/interval.md for the derivation and the command-line usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from .errors import ConfigError

__all__ = [
    "IntervalResult", "MetricsSummary", "young_interval", "daly_interval", "waste_fraction",
    "optimal_steps", "best_integer_steps", "auto_interval", "analyse", "summarise_metrics",
    "percentile", "format_table", "plot", "main",
]


# ---------------------------------------------------------------------------- validation

def _positive(name: str, value) -> float:
    """``value`` as a float, or ConfigError if it is not a finite number > 0."""
    v = _number(name, value)
    if v <= 0.0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return v


def _non_negative(name: str, value) -> float:
    """``value`` as a float, or ConfigError if it is not a finite number >= 0."""
    v = _number(name, value)
    if v < 0.0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return v


def _number(name: str, value) -> float:
    # bool is an int subclass; True as an MTBF is a bug, not one second.
    if value is None or isinstance(value, bool):
        raise ConfigError(f"{name} is missing (got {value!r})")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return v


# ---------------------------------------------------------------------------- formulas

def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum compute time between checkpoints, in seconds:
    ``sqrt(2 * stall * MTBF)``."""
    d, m = _positive("stall", stall_s), _positive("MTBF", mtbf_s)
    return math.sqrt(2.0 * d * m)


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum compute time between checkpoints, in seconds.

    ``sqrt(2 d M) * (1 + sqrt(d/(2M))/3 + (d/(2M))/9) - d`` for ``d < 2M``, else ``M``.
    """
    d, m = _positive("stall", stall_s), _positive("MTBF", mtbf_s)
    if d >= 2.0 * m:
        # Checkpointing costs at least two MTBFs: the series no longer converges usefully
        # and Daly's estimate is simply one MTBF of compute per checkpoint.
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def waste_fraction(n_steps: float, stall_s: float, step_time_s: float, mtbf_s: float,
                   load_time_s: float = 0.0) -> float:
    """Wasted time per unit of useful time when checkpointing every ``n_steps`` steps:
    ``P = stall/(N T_step) + N T_step/(2 MTBF) + T_load/MTBF``."""
    n = _positive("interval (steps)", n_steps)
    d, t = _positive("stall", stall_s), _positive("step time", step_time_s)
    m, r = _positive("MTBF", mtbf_s), _non_negative("load time", load_time_s)
    return d / (n * t) + n * t / (2.0 * m) + r / m


def optimal_steps(stall_s: float, step_time_s: float, mtbf_s: float) -> float:
    """The real-valued optimum ``N* = sqrt(2 stall / (p T_step^2))`` with ``p = 1/MTBF``.

    The load time shifts ``P`` by a constant, so it does not move the optimum.
    """
    d, t = _positive("stall", stall_s), _positive("step time", step_time_s)
    p = 1.0 / _positive("MTBF", mtbf_s)
    return math.sqrt(2.0 * d / (p * t * t))


def best_integer_steps(stall_s: float, step_time_s: float, mtbf_s: float) -> int:
    """The whole number of steps >= 1 that minimises ``P``: floor or ceil of ``N*``."""
    n_star = optimal_steps(stall_s, step_time_s, mtbf_s)
    lo = max(1, math.floor(n_star))
    hi = max(1, math.ceil(n_star))
    # P is convex in N, so the integer optimum is one of the two neighbours of N*.
    p_lo = waste_fraction(lo, stall_s, step_time_s, mtbf_s)
    p_hi = waste_fraction(hi, stall_s, step_time_s, mtbf_s)
    return lo if p_lo <= p_hi else hi


def auto_interval(stall_s: float, step_time_s: float, mtbf_s: float,
                  load_time_s: float = 0.0) -> int:
    """The checkpoint interval in steps (an int >= 1) that ``Checkpointer(interval="auto")``
    uses, from its measured stall and step time. Raises ConfigError on non-positive input."""
    _non_negative("load time", load_time_s)  # validated for the caller; it cannot move N*
    return best_integer_steps(stall_s, step_time_s, mtbf_s)


# ---------------------------------------------------------------------------- one scheme

@dataclass(frozen=True)
class IntervalResult:
    """The optimum for one scheme. Times in seconds, fractions in [0, 1] except ``waste``.

    ``waste_fraction`` (P), ``overhead`` and ``goodput`` are evaluated at ``n_best_steps``,
    the interval one actually configures; ``interval_s = n_best_steps * step_time_s``.
    """

    name: str
    stall_s: float
    step_time_s: float
    mtbf_s: float
    load_time_s: float
    n_best: float          # N*, unrounded
    n_best_steps: int      # the best whole number of steps >= 1
    interval_s: float      # n_best_steps * step_time_s
    waste_fraction: float  # P at n_best_steps: wasted time per unit of useful time
    overhead: float        # P / (1 + P): fraction of all (GPU) time that is wasted
    goodput: float         # 1 / (1 + P): fraction of all time spent on useful training
    young_s: float
    daly_s: float

    @property
    def first_order_reliable(self) -> bool:
        """False when the stall is so large against the MTBF that Daly's ``delta >= 2M``
        branch applies and the first-order ``N*`` should not be trusted."""
        return self.stall_s < 2.0 * self.mtbf_s

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field plus ``young_steps`` and ``daly_steps``."""
        d = asdict(self)
        d["young_steps"] = self.young_s / self.step_time_s
        d["daly_steps"] = self.daly_s / self.step_time_s
        d["first_order_reliable"] = self.first_order_reliable
        return d


def analyse(stall_s: float, step_time_s: float, mtbf_s: float, load_time_s: float = 0.0,
            name: str = "measured") -> IntervalResult:
    """Everything the CLI reports for one scheme. Raises ConfigError on bad numbers."""
    n_best = optimal_steps(stall_s, step_time_s, mtbf_s)
    n_int = best_integer_steps(stall_s, step_time_s, mtbf_s)
    p = waste_fraction(n_int, stall_s, step_time_s, mtbf_s, load_time_s)
    return IntervalResult(
        name=name, stall_s=float(stall_s), step_time_s=float(step_time_s),
        mtbf_s=float(mtbf_s), load_time_s=float(load_time_s),
        n_best=n_best, n_best_steps=n_int, interval_s=n_int * float(step_time_s),
        waste_fraction=p, overhead=p / (1.0 + p), goodput=1.0 / (1.0 + p),
        young_s=young_interval(stall_s, mtbf_s), daly_s=daly_interval(stall_s, mtbf_s))


# ---------------------------------------------------------------------------- metrics.jsonl

@dataclass(frozen=True)
class MetricsSummary:
    """What ``--from-metrics`` takes from a checkpoint directory's ``metrics.jsonl``."""

    path: str
    mode: str
    checkpoints: int
    stall_median_s: float
    stall_p95_s: float
    step_time_median_s: Optional[float]  # None when no record has a measured step time


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation between order statistics
    (numpy's default), defined for a single value too."""
    if not values:
        raise ConfigError("percentile of no values")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _read_records(directory: str) -> List[dict]:
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"no metrics file: {path} does not exist (is {directory!r} a gockpt "
                          "checkpoint directory with at least one committed checkpoint?)")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object")
            records.append(rec)
    if not records:
        raise ConfigError(f"{path} is empty: no checkpoint has been committed yet")
    return records


def summarise_metrics(directory: str) -> MetricsSummary:
    """Median and p95 stall (``blocked_s``) and median step time (``step_time_s``) over the
    checkpoints recorded in ``directory/metrics.jsonl``. Raises ConfigError when the file is
    missing, empty or malformed. ``step_time_median_s`` is None when no record has a
    measured step time (the caller then needs one from elsewhere)."""
    path = os.path.join(directory, "metrics.jsonl")
    records = _read_records(directory)
    stalls, steps, modes = [], [], []
    for i, rec in enumerate(records, 1):
        if "blocked_s" not in rec:
            raise ConfigError(f"{path}: record {i} has no 'blocked_s'")
        stalls.append(_non_negative(f"{path}: record {i} blocked_s", rec["blocked_s"]))
        # 0.0 means the checkpointer had not yet timed a step (e.g. a checkpoint at step 1).
        st = _non_negative(f"{path}: record {i} step_time_s", rec.get("step_time_s", 0.0))
        if st > 0.0:
            steps.append(st)
        if rec.get("mode") and rec["mode"] not in modes:
            modes.append(str(rec["mode"]))
    return MetricsSummary(
        path=path, mode="+".join(modes) or "measured", checkpoints=len(records),
        stall_median_s=statistics.median(stalls), stall_p95_s=percentile(stalls, 0.95),
        step_time_median_s=statistics.median(steps) if steps else None)


# ---------------------------------------------------------------------------- output

_COLUMNS = [  # (header, unit, formatter)
    ("scheme", "", lambda r: r.name),
    ("stall", "[s]", lambda r: f"{r.stall_s:.4g}"),
    ("N*", "[steps]", lambda r: f"{r.n_best:.4g}"),
    ("N used", "[steps]", lambda r: str(r.n_best_steps)),
    ("interval", "[s]", lambda r: f"{r.interval_s:.4g}"),
    ("waste P", "[%]", lambda r: f"{100 * r.waste_fraction:.4g}"),
    ("overhead", "[% GPU]", lambda r: f"{100 * r.overhead:.4g}"),
    ("goodput", "[%]", lambda r: f"{100 * r.goodput:.4g}"),
    ("Young", "[s]", lambda r: f"{r.young_s:.4g}"),
    ("Daly", "[s]", lambda r: f"{r.daly_s:.4g}"),
]


def format_table(results: Sequence[IntervalResult],
                 metrics: Optional[MetricsSummary] = None) -> str:
    """A plain-text table, one row per scheme, units in the header, columns aligned."""
    r0 = results[0]
    lines = [f"MTBF {r0.mtbf_s:.6g} s (failure rate {1.0 / r0.mtbf_s:.4g} /s), "
             f"step time {r0.step_time_s:.4g} s, load time {r0.load_time_s:.4g} s"]
    if metrics is not None:
        lines.append(f"from {metrics.path}: {metrics.checkpoints} checkpoint(s), mode "
                     f"{metrics.mode}, stall median {metrics.stall_median_s:.4g} s, "
                     f"p95 {metrics.stall_p95_s:.4g} s")
        if metrics.stall_p95_s > 0.0:
            # The median drives the row; the p95 shows how much a slow tail would move N.
            n95 = best_integer_steps(metrics.stall_p95_s, r0.step_time_s, r0.mtbf_s)
            lines.append(f"at the p95 stall the best interval would be {n95} steps")
    cells = [[h for h, _, _ in _COLUMNS], [u for _, u, _ in _COLUMNS]]
    cells += [[fmt(r) for _, _, fmt in _COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines.append("")
    for row in cells:
        # Scheme names left-aligned, numbers right-aligned so the digits line up.
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    lines.append("")
    lines.append("N*: optimal interval; N used: best whole number of steps (waste, overhead, "
                 "goodput and interval are at N used).")
    lines.append("waste P: wasted per useful second; overhead = P/(1+P); goodput = 1/(1+P). "
                 "Young, Daly: optimal compute time between checkpoints.")
    for r in results:
        if not r.first_order_reliable:
            lines.append(f"warning: {r.name}: stall >= 2 x MTBF, the first-order N* is "
                         "unreliable; Daly's estimate is one MTBF.")
    return "\n".join(lines)


def to_json(results: Sequence[IntervalResult], metrics: Optional[MetricsSummary] = None) -> dict:
    """The first scheme's fields at top level (so a single-scheme call reads directly),
    every scheme under ``schemes``, and the metrics summary under ``metrics`` if any."""
    out = results[0].to_dict()
    out["failure_rate_per_s"] = 1.0 / results[0].mtbf_s
    out["schemes"] = [r.to_dict() for r in results]
    if metrics is not None:
        out["metrics"] = asdict(metrics)
        if metrics.stall_p95_s > 0.0:
            out["metrics"]["n_best_steps_at_p95"] = best_integer_steps(
                metrics.stall_p95_s, results[0].step_time_s, results[0].mtbf_s)
    return out


def plot(results: Sequence[IntervalResult], out_path: str) -> None:
    """Save a plot of P against the interval (steps, log axis) per scheme, optimum marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed; the CLI only writes a file
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    lo = max(1.0, min(r.n_best for r in results) / 20.0)
    hi = max(max(r.n_best for r in results) * 20.0, lo * 10.0)
    ns = [lo * (hi / lo) ** (i / 399.0) for i in range(400)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ys = [100 * waste_fraction(n, r.stall_s, r.step_time_s, r.mtbf_s, r.load_time_s)
              for n in ns]
        (line,) = ax.plot(ns, ys, label=f"{r.name} (stall {r.stall_s:.3g} s)")
        ax.plot([r.n_best_steps], [100 * r.waste_fraction], "o", color=line.get_color())
        ax.annotate(f"N={r.n_best_steps}", (r.n_best_steps, 100 * r.waste_fraction),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"checkpoint interval [steps of {results[0].step_time_s:.3g} s]")
    ax.set_ylabel("wasted time P [% of useful time]")
    ax.set_title(f"Waste vs interval, MTBF {results[0].mtbf_s:.4g} s (optimum marked)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gockpt-interval",
        description="The checkpoint interval that minimises wasted time "
                    "(Young 1974, Daly 2006, GoCkpt). See docs/interval.md.")
    rate = ap.add_mutually_exclusive_group()
    rate.add_argument("--mtbf", type=float, metavar="SECONDS",
                      help="mean time between failures of the whole job")
    rate.add_argument("--failure-rate", type=float, metavar="PER_SECOND",
                      help="failures per second (= 1/MTBF)")
    ap.add_argument("--step-time", type=float, metavar="SECONDS",
                    help="time of one training step (default with --from-metrics: median "
                         "step_time_s of the file)")
    ap.add_argument("--stall", type=float, metavar="SECONDS",
                    help="time one checkpoint blocks training (default with --from-metrics: "
                         "median blocked_s of the file)")
    ap.add_argument("--load-time", type=float, default=0.0, metavar="SECONDS",
                    help="time to restart from a checkpoint after a failure (default 0)")
    ap.add_argument("--name", default=None,
                    help="row name for --stall (default: the mode in --from-metrics, else "
                         "'measured')")
    ap.add_argument("--compare", nargs="+", default=[], metavar="NAME=STALL",
                    help="extra rows, e.g. sync=12 async=1.5 gockpt-o=0.2 (stall in seconds)")
    ap.add_argument("--from-metrics", metavar="DIR",
                    help="take step time and stall from DIR/metrics.jsonl")
    ap.add_argument("--json", action="store_true", help="print a JSON object, not a table")
    ap.add_argument("--plot", metavar="OUT.png", help="write waste against interval to a PNG")
    return ap


def _parse_compare(items: Sequence[str]) -> List[tuple]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--compare expects NAME=STALL, got {item!r}")
        out.append((name, _positive(f"--compare {name} stall", value)))
    return out


def _mtbf(args) -> float:
    if args.mtbf is not None:
        return _positive("--mtbf", args.mtbf)
    if args.failure_rate is not None:
        return 1.0 / _positive("--failure-rate", args.failure_rate)
    raise ConfigError("give --mtbf SECONDS or --failure-rate PER_SECOND")


def _rows(args, metrics: Optional[MetricsSummary]) -> List[tuple]:
    """(name, stall) per row: the measured or given stall first, then --compare."""
    rows = []
    stall = args.stall
    if stall is None and metrics is not None:
        stall = metrics.stall_median_s
    if stall is not None:
        name = args.name or (metrics.mode if metrics is not None else "measured")
        rows.append((name, stall))
    rows += _parse_compare(args.compare)
    if not rows:
        raise ConfigError("give --stall SECONDS, --compare NAME=STALL ... or --from-metrics DIR")
    return rows


def run(args) -> str:
    """Compute and render (table or JSON) from parsed arguments; writes the plot if asked."""
    mtbf = _mtbf(args)
    metrics = summarise_metrics(args.from_metrics) if args.from_metrics else None
    step = args.step_time
    if step is None and metrics is not None:
        step = metrics.step_time_median_s
        if step is None:
            raise ConfigError(f"{metrics.path}: no record has a measured step_time_s (all 0 "
                              "or missing); pass --step-time SECONDS")
    if step is None:
        raise ConfigError("give --step-time SECONDS (or --from-metrics DIR)")
    results = [analyse(stall, step, mtbf, args.load_time, name=name)
               for name, stall in _rows(args, metrics)]
    if args.plot:
        plot(results, args.plot)
    if args.json:
        return json.dumps(to_json(results, metrics), indent=2, sort_keys=True)
    return format_table(results, metrics)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point. Returns 0, or 2 after a one-line message on stderr."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error (or --help)
        return int(exc.code or 0)
    try:
        print(run(args))
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        print(f"gockpt-interval: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
