"""``gockpt verify``: print what :func:`gockpt.verify` found."""

from __future__ import annotations

import sys

from ..storage.verify import CheckpointReport, verify
from .common import PROG, human, print_json, resolve_checkpoint, warn


def cmd_verify(args) -> int:
    """``gockpt verify PATH [--all] [--json]``: exit 1 if anything does not verify."""
    path = args.path
    if not args.all:  # else verify() lists the checkpoints of the run directory PATH
        path, _run, warns = resolve_checkpoint(args.path)
        warn(warns)
    report = verify(path, all=args.all)
    if args.json:
        results = [r.to_json() for r in report.checkpoints]
        print_json(results if args.all else results[0])
        return 0 if report.ok else 1
    for r in report.checkpoints:
        print_report(r)
    for r in report.checkpoints:
        if not r.ok:
            print(f"{PROG}: verification failed: {r.path}", file=sys.stderr)
    return 0 if report.ok else 1


def print_report(r: CheckpointReport) -> None:
    """One checkpoint's result: an ``OK`` line, or a line per problem and a ``FAILED`` line."""
    step = f" (step {r.step})" if r.step is not None else ""
    ranks = f"{r.world_size} ranks, " if r.world_size else ""
    if r.ok:
        print(f"OK       {r.path}{step}: {ranks}{r.tensors} tensors, {human(r.bytes)}, "
              "all checksums match")
        return
    for m in r.missing:
        print(f"MISSING  part {m.part} (rank {m.rank} of {r.world_size}): {m.error}")
    for b in r.bad:
        err = b.error
        if repr(b.tensor) not in err or str(b.file) not in err:
            err = f"tensor {b.tensor!r} in file {b.file!r}: {err}"
        print(f"CORRUPT  {err}")
    for prob in r.problems:
        print(f"CORRUPT  {prob}")
    total = r.tensors + len(r.bad)
    if r.step is None and not total:
        print(f"FAILED   {r.path}: no tensor could be checked")
        return
    where = ""
    if r.parts:
        where = f" in {len(r.parts) - len(r.missing)} of {r.world_size} part(s)"
        by_part = [f"{p.name} {p.bad}" for p in r.parts if p.bad]
        if by_part:
            where += f" ({', '.join(by_part)})"
    print(f"FAILED   {r.path}{step}: {len(r.bad)} of {total} tensors bad{where}"
          + (f", {len(r.missing)} part(s) missing or unreadable" if r.missing else "")
          + (f", {len(r.problems)} other problem(s)" if r.problems else ""))
