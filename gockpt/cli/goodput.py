"""``gockpt goodput DIR``: the goodput accounting of a run (:mod:`gockpt.goodput`) from the
records its processes left in ``DIR/metrics.jsonl``: a table, ``--json``, ``--plot FILE``
(progress against wall time with the failures marked, and the wall time by category). The
plot is shared with ``experiments/goodput.py``, which draws several schemes side by side."""

from __future__ import annotations

import json
from typing import Dict, List, Tuple

from .. import goodput
from ..core.errors import ConfigError
from .common import existing_directory

COLORS = {"productive": "#2e7d32", "checkpoint": "#f9a825", "restore": "#1565c0",
          "wasted": "#c62828", "other": "#9e9e9e"}


def cmd_goodput(args) -> int:
    directory = existing_directory(args.dir)
    records = goodput.read_records(directory)
    result = goodput.account(records)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        print(goodput.format_table(result, title=f"goodput of {directory}"))
    if args.plot:
        plot({directory: (result, goodput.progress(records))}, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def plot(runs: Dict[str, Tuple[goodput.Goodput, List[List[Tuple[float, int]]]]],
         path: str) -> None:
    """Save (PNG or SVG, by ``path``'s suffix) the progress of each run -- steps against wall
    time, one line per process, an ``x`` where a process died -- and beside it each run's
    wall time by category (stacked bars, goodput written on them)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.6 * len(runs) + 4),
                                      gridspec_kw={"width_ratios": [3, 2]})
    names = list(runs)
    for name in names:
        result, processes = runs[name]
        color = None
        for i, points in enumerate(processes):
            if not points:
                continue
            xs, ys = zip(*points)
            (line,) = left.plot(xs, ys, color=color, label=name if i == 0 else None)
            color = line.get_color()
            if i + 1 < len(processes):  # this process died: the next one restarted
                left.plot([xs[-1]], [ys[-1]], "x", color=color, markersize=8)
    left.set_xlabel("wall time [s]")
    left.set_ylabel("training step reached")
    left.set_title("progress (x: a process killed; the next resumes from its checkpoint)")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    for row, name in enumerate(names):
        result = runs[name][0]
        at = 0.0
        for category in goodput.CATEGORIES:
            share = 100 * result.seconds[category] / result.wall_s if result.wall_s else 0.0
            right.barh(row, share, left=at, color=COLORS[category],
                       label=category if row == 0 else None)
            at += share
        right.text(1, row, f"{100 * result.goodput:.1f}%", va="center", fontsize=8,
                   color="white")
    right.set_yticks(range(len(names)), [n[-28:] for n in names], fontsize=8)
    right.set_xlabel("share of wall time [%]")
    right.set_title("goodput and badput by category")
    right.set_xlim(0, 100)
    right.invert_yaxis()
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
