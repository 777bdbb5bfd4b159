"""Goodput: how much of a job's wall time trained the model that survived, from the records
its processes left in ``metrics.jsonl`` (:mod:`gockpt.core.runlog`, the checkpoints' records),
in the categories of Google's ml-goodput-measurement:

    productive    steps whose result the job kept (what the final state holds)
    checkpoint    training blocked by checkpoints (each checkpoint's ``blocked_s``; at the end,
                  ``close()`` completing the last one)
    restore       each process's start until it trains: interpreter, imports, model, load
    wasted        steps computed after the checkpoint the next process restored, computed again
    other         the rest: between a process's last record and the next one's start (the
                  failure's detection, the launcher's restart; and the steps a killed process
                  computed after its last progress record, at most ``PROGRESS_EVERY_S``)

A process (an *attempt*) is identified by its ``pid`` and ``process_start``; its records are
rank 0's. Wall time runs from the first process's start to the last record. Every second is in
exactly one category.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from .core import metrics
from .core.errors import ConfigError

CATEGORIES = ("productive", "checkpoint", "restore", "wasted", "other")


@dataclass
class Attempt:
    """One process of the job, as its records tell it."""

    pid: int
    process_start: float
    train_start: float        # when it could train: its Checkpointer built, its load done
    end: float                # its last record
    restored_step: int        # the step it went on from (0: from scratch)
    last_step: Optional[int]  # the last step it recorded
    ended: bool               # it recorded its end (close()); False: killed or failed
    trained_until: float      # its last step boundary where it recorded its end, else ``end``
    trained: bool             # it got to train (its Checkpointer built or its load done)
    checkpoints: List[dict] = field(default_factory=list)  # its committed checkpoints
    records: List[dict] = field(default_factory=list, repr=False)  # all of its records


@dataclass
class Goodput:
    """A job's wall time by category (seconds), its goodput and what it survived."""

    wall_s: float
    seconds: Dict[str, float]
    failures: int              # attempts that did not record their end
    attempts: int
    final_step: Optional[int]
    checkpoints: int
    interval_steps: Optional[float]  # the median spacing of the committed checkpoints

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "goodput": self.goodput}


def attempts(records: List[dict]) -> List[Attempt]:
    """The job's processes in start order, from rank 0's records of every kind."""
    by: Dict[Tuple[int, float], List[dict]] = {}
    for r in records:
        if r.get("rank", 0) == 0 and "pid" in r and "time" in r:
            by.setdefault((r["pid"], r["process_start"]), []).append(r)
    out = []
    for (pid, started), recs in sorted(by.items(), key=lambda item: item[0][1]):
        kinds: Dict[str, List[dict]] = {}
        for r in recs:
            kinds.setdefault(r.get("record", "checkpoint"), []).append(r)
        ready = [r["time"] for r in kinds.get("start", []) + kinds.get("load", [])]
        loads = kinds.get("load", [])
        steps = [r["step"] for r in kinds.get("progress", []) + kinds.get("end", [])
                 if r.get("step") is not None] + \
            [r["final_step"] for r in kinds.get("checkpoint", [])]
        end = max(r["time"] for r in recs)
        boundary = [r["boundary_time"] for r in kinds.get("end", []) if r.get("boundary_time")]
        out.append(Attempt(  # (one that never trained: all of its life restored it)
            pid=pid, process_start=started, train_start=max(ready) if ready else end,
            end=end, restored_step=loads[-1]["step"] if loads else 0,
            last_step=max(steps) if steps else None, ended=bool(kinds.get("end")),
            trained_until=min(boundary[-1], end) if boundary else end,
            trained=bool(ready),
            checkpoints=sorted(kinds.get("checkpoint", []), key=lambda r: r["final_time"]),
            records=recs))
    return out


def account(records: List[dict]) -> Goodput:
    """The accounting of the job whose records these are (module docstring)."""
    runs = attempts(records)
    if not runs:
        raise ConfigError("no process of the job recorded its start (gockpt records them from "
                          "this version on: a Checkpointer's start, gockpt.load, progress, close)")
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for i, run in enumerate(runs):
        seconds["restore"] += run.train_start - run.process_start
        blocked = [(c["final_time"], c["blocked_s"]) for c in run.checkpoints]
        seconds["checkpoint"] += sum(b for _, b in blocked)
        if i + 1 < len(runs):
            seconds["other"] += max(0.0, runs[i + 1].process_start - run.end)
        # kept: what the next process that trained went on from (one that died starting or
        # loading restored nothing); the last one's steps, where it ended; else what a restart
        # would load, its last checkpoint
        resumed = next((r for r in runs[i + 1:] if r.trained), None)
        if resumed is not None:
            kept_until = _reached(run, resumed.restored_step)
        elif run.ended:
            kept_until = run.trained_until
        else:
            kept_until = _reached(run, max([c["final_step"] for c in run.checkpoints],
                                           default=run.restored_step))
        # its close() completing the last checkpoint blocked the job's end
        seconds["checkpoint"] += run.end - run.trained_until
        training = run.trained_until - run.train_start - sum(b for _, b in blocked)
        kept = kept_until - run.train_start - sum(b for t, b in blocked if t <= kept_until)
        kept = min(max(kept, 0.0), max(training, 0.0))
        seconds["productive"] += kept
        seconds["wasted"] += max(training - kept, 0.0)
    wall = runs[-1].end - runs[0].process_start
    # overlapping processes (a restart before the last record of the killed one) or clock
    # steps: what is left over or missing is "other"
    seconds["other"] += wall - sum(seconds.values())
    finals = sorted({c["final_step"] for run in runs for c in run.checkpoints})
    spacing = sorted(b - a for a, b in zip(finals, finals[1:]))
    return Goodput(wall_s=wall, seconds=seconds, failures=sum(not r.ended for r in runs),
                   attempts=len(runs), final_step=runs[-1].last_step, checkpoints=len(finals),
                   interval_steps=_median(spacing))


def progress(records: List[dict]) -> List[List[Tuple[float, int]]]:
    """Per process: (seconds since the first process started, step) at each step it recorded
    (its start at its restored step, progress, checkpoints at their boundary, its end)."""
    runs = attempts(records)
    if not runs:
        return []
    t0 = runs[0].process_start
    out = []
    for run in runs:
        points = [(run.train_start, run.restored_step)]
        for r in run.records:
            kind = r.get("record", "checkpoint")
            if kind == "progress":
                points.append((r["time"], r["step"]))
            elif kind == "checkpoint":
                points.append((r["final_time"], r["final_step"]))
            elif kind == "end" and r.get("step") is not None:
                points.append((run.trained_until, r["step"]))
        out.append([(t - t0, step) for t, step in sorted(points)])
    return out


def _reached(run: Attempt, step: int) -> float:
    """When ``run`` reached ``step``: the boundary of the checkpoint that holds it; a step the
    memory tier's log restored, between the run's records around it (interpolated, or on at
    the pace of its last two); its training start where it never went past where it began."""
    if step <= run.restored_step:
        return run.train_start
    for c in run.checkpoints:
        if c["final_step"] == step:
            return c["final_time"]
    points = sorted([(run.train_start, run.restored_step)] + [
        (r["time"], r["step"]) for r in run.records
        if r.get("record") == "progress" and r.get("step") is not None] + [
        (c["final_time"], c["final_step"]) for c in run.checkpoints])
    if len(points) < 2 or points[-1][1] == run.restored_step:
        return run.train_start  # (restored from a checkpoint another process took)
    after = next((i for i, (_, s) in enumerate(points) if s >= step), None)
    (t0, s0), (t1, s1) = (points[-2], points[-1]) if after is None or after == 0 else \
        (points[after - 1], points[after])
    if s1 == s0:
        return t1
    return min(t0 + (t1 - t0) * (step - s0) / (s1 - s0), run.end)


def _median(values: List[float]) -> Optional[float]:
    if not values:
        return None
    mid = len(values) // 2
    return float(values[mid]) if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def read(directory: str) -> Goodput:
    """:func:`account` of ``directory/metrics.jsonl`` (ConfigError naming it when missing or
    malformed)."""
    return account(read_records(directory))


def read_records(directory: str) -> List[dict]:
    """Every record of ``directory/metrics.jsonl`` (what :func:`account` and
    :func:`progress` take; ConfigError naming it when missing or malformed)."""
    try:
        return metrics.read(directory, record=None)
    except FileNotFoundError:
        raise ConfigError(f"{directory}: no metrics.jsonl (not a gockpt run directory?)") \
            from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def format_table(g: Goodput, title: str = "") -> str:
    """The accounting as a plain-text table: seconds and share of wall time per category."""
    lines = [title] if title else []
    lines.append(f"wall {g.wall_s:.1f} s, goodput {100 * g.goodput:.1f}%, "
                 f"{g.failures} failure(s) over {g.attempts} process(es), final step "
                 f"{g.final_step}, {g.checkpoints} checkpoint(s)"
                 + (f" every {g.interval_steps:g} steps" if g.interval_steps else ""))
    for name in CATEGORIES:
        s = g.seconds[name]
        share = 100 * s / g.wall_s if g.wall_s > 0 and math.isfinite(s) else 0.0
        lines.append(f"  {name:<11} {s:>9.2f} s  {share:>5.1f}%")
    return "\n".join(lines)


__all__ = ["CATEGORIES", "Attempt", "Goodput", "attempts", "account", "progress", "read",
           "read_records", "format_table"]
