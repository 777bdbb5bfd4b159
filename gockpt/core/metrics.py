"""Per-checkpoint measurements, appended as one JSON line to ``<dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional


@dataclass
class CheckpointMetrics:
    """What one checkpoint cost. Times in seconds."""

    start_step: int
    final_step: int
    mode: str
    overlap_steps: int
    state_bytes: int = 0
    replayed_bytes: int = 0       # state bytes copied during the window and brought to F by
    copied_at_f_bytes: int = 0    # the replay; state bytes copied at version F (the last
    #                               group, slots copied at F, parameters whose update the
    #                               replay does not reproduce)
    grad_bytes: int = 0
    grad_transport: str = ""      # how the replayed gradients crossed: fp32, bf16, bf16+fp32
    grad_steps: int = 0           # training steps whose gradients crossed for the replay
    grad_bytes_per_step: int = 0
    blocked_s: float = 0.0
    blocked_by_hook_s: Dict[str, float] = field(default_factory=dict)
    copy_s: float = 0.0
    replay_s: float = 0.0
    persist_s: float = 0.0
    time_to_staged_s: float = 0.0
    time_to_durable_s: float = 0.0
    self_check_blocks: int = 0
    self_check_mismatches: int = 0
    verify_tensors: int = 0       # tensors checked against the live state at F by digest
    verify_mismatches: int = 0
    verify_live_s: float = 0.0    # digests of the live tensors (a background thread; on a GPU
                                  # the time to queue them on a side stream)
    verify_s: float = 0.0         # verify_live_s + digests of the staged copy and comparison
    step_time_s: float = 0.0
    host_bytes: int = 0           # host memory held for staging (state copy + gradients)
    written_bytes: int = 0        # the size of this rank's data file
    rank: int = 0                 # which rank's record (several ranks: one record each)
    world_size: int = 1
    final_time: float = 0.0       # wall clock at the boundary of its step (the state it holds)
    time: float = 0.0             # wall clock when durable
    pid: int = 0                  # the process that took it (a restart is another: the
    process_start: float = 0.0    # goodput accounting's attempts, gockpt.core.runlog)

    def add_blocked(self, hook: str, seconds: float) -> None:
        self.blocked_s += seconds
        self.blocked_by_hook_s[hook] = self.blocked_by_hook_s.get(hook, 0.0) + seconds

    def add_grad_step(self, transport: str, nbytes: int, new_step: bool = True) -> None:
        """Gradients of one optimizer step crossed the link in ``transport`` (fp32 or bf16);
        ``new_step`` False: another param group of a step already counted (DeepSpeed's ZeRO
        step the optimizer group by group)."""
        if transport != self.grad_transport:  # (the usual case: one transport, named already)
            used = set(self.grad_transport.split("+")) - {""} | {transport}
            self.grad_transport = "+".join(sorted(used, key=("bf16", "fp32").index))
        self.grad_bytes += nbytes
        self.grad_steps += new_step
        self.grad_bytes_per_step = self.grad_bytes // max(1, self.grad_steps)

    def to_dict(self) -> dict:
        return asdict(self)


def append(directory: str, metrics: CheckpointMetrics) -> None:
    """Append one line; a single write so concurrent readers see whole lines."""
    _append_line(directory, metrics.to_dict())


def _append_line(directory: str, record: dict) -> None:
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(os.path.join(directory, "metrics.jsonl"), "a") as f:
        f.write(line)


def append_record(directory: str, record: dict, quiet: bool = False) -> None:
    """Append a record of another kind than a checkpoint's (``record["record"]`` says which,
    e.g. ``"upload"`` for the remote tier, ``"start"`` for :mod:`gockpt.core.runlog`); a failure
    to write it is logged (at debug level with ``quiet``), not raised."""
    try:
        _append_line(directory, record)
    except OSError as exc:
        logging.getLogger("gockpt").log(logging.DEBUG if quiet else logging.WARNING,
                                        "gockpt: cannot append to %s/metrics.jsonl: %s",
                                        directory, exc)


def read(directory: str, rank: Optional[int] = None,
         record: Optional[str] = "checkpoint") -> List[dict]:
    """The metrics records of a checkpoint directory, oldest first (blank lines skipped); with
    ``rank``, only that rank's (a checkpoint of several ranks has one record per rank).
    ``record``: which kind -- ``"checkpoint"`` (one per rank and checkpoint), ``"upload"``
    (one per checkpoint copied to the remote tier), a process's ``"start"``, ``"loading"``,
    ``"load"``, ``"progress"`` or ``"end"`` (:mod:`gockpt.core.runlog`), or None for every
    record.

    Raises FileNotFoundError when ``<directory>/metrics.jsonl`` does not exist, and
    ValueError naming the file and line (``.../metrics.jsonl:2: not valid JSON (...)``) when
    a line is not a JSON object."""
    path = os.path.join(directory, "metrics.jsonl")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            if record in (None, entry.get("record", "checkpoint")) and (
                    rank is None or entry.get("rank", 0) == rank):
                records.append(entry)
    return records
