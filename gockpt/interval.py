"""The checkpoint interval that minimises wasted time, from the stall gockpt measured.

A cheaper checkpoint pays off by checkpointing more often, so that a failure loses less
work. This module turns a measured stall (the time one checkpoint blocks training) and
step time into the interval that minimises the expected waste, and shows what a smaller
stall buys. ``auto_interval`` is what ``Checkpointer(interval="auto")`` calls; the console
script ``gockpt-interval`` (also ``python -m gockpt.cli.interval``) is :mod:`gockpt.cli.interval`.

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

import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from .core import metrics
from .core.errors import ConfigError

__all__ = [
    "IntervalResult", "MetricsSummary", "young_interval", "daly_interval", "waste_fraction",
    "optimal_steps", "best_integer_steps", "auto_interval", "analyse", "summarise_metrics",
    "percentile", "positive", "non_negative",
]


# ---------------------------------------------------------------------------- validation

def positive(name: str, value) -> float:
    """``value`` as a float, or ConfigError naming ``name`` if it is not a finite number > 0."""
    v = _number(name, value)
    if v <= 0.0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return v


def non_negative(name: str, value) -> float:
    """``value`` as a float, or ConfigError naming ``name`` if it is not a finite number >= 0."""
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
    d, m = positive("stall", stall_s), positive("MTBF", mtbf_s)
    return math.sqrt(2.0 * d * m)


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum compute time between checkpoints, in seconds.

    ``sqrt(2 d M) * (1 + sqrt(d/(2M))/3 + (d/(2M))/9) - d`` for ``d < 2M``, else ``M``.
    """
    d, m = positive("stall", stall_s), positive("MTBF", mtbf_s)
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
    n = positive("interval (steps)", n_steps)
    d, t = positive("stall", stall_s), positive("step time", step_time_s)
    m, r = positive("MTBF", mtbf_s), non_negative("load time", load_time_s)
    return d / (n * t) + n * t / (2.0 * m) + r / m


def optimal_steps(stall_s: float, step_time_s: float, mtbf_s: float) -> float:
    """The real-valued optimum ``N* = sqrt(2 stall / (p T_step^2))`` with ``p = 1/MTBF``.

    The load time shifts ``P`` by a constant, so it does not move the optimum.
    """
    d, t = positive("stall", stall_s), positive("step time", step_time_s)
    p = 1.0 / positive("MTBF", mtbf_s)
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
    non_negative("load time", load_time_s)  # validated for the caller; it cannot move N*
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
    """The records of ``directory/metrics.jsonl`` (:func:`gockpt.core.metrics.read`); ConfigError
    when the file is missing, malformed or empty."""
    path = os.path.join(directory, "metrics.jsonl")
    try:
        records = metrics.read(directory)
    except FileNotFoundError:
        raise ConfigError(f"no metrics file: {path} does not exist (is {directory!r} a gockpt "
                          "checkpoint directory with at least one committed checkpoint?)") from None
    except ValueError as exc:  # names the file and line
        raise ConfigError(str(exc)) from None
    if not records:
        raise ConfigError(f"{path} is empty: no checkpoint has been committed yet")
    return records


def _one_per_checkpoint(records: List[dict]) -> List[dict]:
    """One record per checkpoint: a checkpoint of several ranks has one per rank (``rank``,
    ``world_size``), merged into the slowest rank's -- training waits for it."""
    out: List[dict] = []
    seen: dict = {}
    for rec in records:
        if not isinstance(rec.get("world_size"), int) or rec["world_size"] <= 1:
            out.append(rec)
            continue
        key = (rec.get("start_step"), rec.get("final_step"), rec["world_size"])
        if key in seen and rec.get("rank") not in seen[key][1]:
            first, ranks = seen[key]
            ranks.add(rec.get("rank"))
            if isinstance(rec.get("blocked_s"), (int, float)) and \
                    isinstance(first.get("blocked_s"), (int, float)):
                first["blocked_s"] = max(first["blocked_s"], rec["blocked_s"])
            continue
        seen[key] = (dict(rec), {rec.get("rank")})
        out.append(seen[key][0])
    return out


def summarise_metrics(directory: str) -> MetricsSummary:
    """Median and p95 stall (``blocked_s``; of several ranks, the slowest's) and median step
    time (``step_time_s``) over the checkpoints recorded in ``directory/metrics.jsonl``. Raises ConfigError when the file is
    missing, empty or malformed. ``step_time_median_s`` is None when no record has a
    measured step time (the caller then needs one from elsewhere)."""
    path = os.path.join(directory, "metrics.jsonl")
    records = _one_per_checkpoint(_read_records(directory))
    stalls, steps, modes = [], [], []
    for i, rec in enumerate(records, 1):
        if "blocked_s" not in rec:
            raise ConfigError(f"{path}: record {i} has no 'blocked_s'")
        stalls.append(non_negative(f"{path}: record {i} blocked_s", rec["blocked_s"]))
        # 0.0 means the checkpointer had not yet timed a step (e.g. a checkpoint at step 1).
        st = non_negative(f"{path}: record {i} step_time_s", rec.get("step_time_s", 0.0))
        if st > 0.0:
            steps.append(st)
        if rec.get("mode") and rec["mode"] not in modes:
            modes.append(str(rec["mode"]))
    return MetricsSummary(
        path=path, mode="+".join(modes) or "measured", checkpoints=len(records),
        stall_median_s=statistics.median(stalls), stall_p95_s=percentile(stalls, 0.95),
        step_time_median_s=statistics.median(steps) if steps else None)
