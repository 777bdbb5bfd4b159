"""``gockpt-interval`` (also ``python -m gockpt.cli.interval``): the checkpoint interval that
minimises wasted time, from a stall and step time given or measured (``--from-metrics DIR``),
as a table, JSON or a plot. The formulas are :mod:`gockpt.interval`'s; this module parses,
renders and reports errors (exit status 0, or 2 after a one-line message on stderr).
See docs/interval.md for the usage and the derivation.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import List, Optional, Sequence

from ..core.errors import ConfigError
from ..interval import (IntervalResult, MetricsSummary, analyse, best_integer_steps, positive,
                        summarise_metrics, waste_fraction)
from .pipe import quiet_on_broken_pipe

__all__ = ["format_table", "to_json", "plot", "run", "main"]

PROG = "gockpt-interval"


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
        prog=PROG,
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
        out.append((name, positive(f"--compare {name} stall", value)))
    return out


def _mtbf(args) -> float:
    if args.mtbf is not None:
        return positive("--mtbf", args.mtbf)
    if args.failure_rate is not None:
        return 1.0 / positive("--failure-rate", args.failure_rate)
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
    return quiet_on_broken_pipe(lambda: _command(args))  # `gockpt-interval ... | head`


def _command(args) -> int:
    try:
        print(run(args))
    except BrokenPipeError:  # the reader went away: quiet_on_broken_pipe
        raise
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
