"""``gockpt inspect``: print (or write as JSON) the summaries built by :mod:`.summary`."""

from __future__ import annotations

import sys

from ..core.paths import shown
from ..storage.manifest import parse as parse_manifest
from ..storage.verify import read_parts
from .common import (PROG, human, date, mtime, no_rank_for_single, print_json, read_manifest,
                     resolve_checkpoint, seconds, table, warn)
from .summary import checkpoint_summary, part_summary, parts_summary, tensor_table

_TIMINGS = [  # (metrics key, label, what)
    ("blocked_s", "training blocked", ""),
    ("copy_s", "copy", "device-to-host copies (cumulative)"),
    ("replay_s", "replay", "optimizer replay on host"),
    ("persist_s", "persist", "write + fsync + commit"),
    ("time_to_staged_s", "time to staged", "start to state in host memory"),
    ("time_to_durable_s", "time to durable", "start to committed on disk"),
    ("step_time_s", "step time", "median training step"),
]
# Metrics the timings block shows by name; any other is listed under "other".
_SHOWN = {key for key, _, _ in _TIMINGS} | {
    "start_step", "final_step", "mode", "overlap_steps", "state_bytes", "grad_bytes",
    "replayed_bytes", "copied_at_f_bytes",
    "blocked_by_hook_s", "self_check_blocks", "self_check_mismatches"}

# Up to this many ranks `inspect` shows one timings column per rank; beyond, rank 0 and the max.
_MAX_RANK_COLUMNS = 8


def cmd_inspect(args) -> int:
    """``gockpt inspect PATH [--rank R] [--json] [--brief]``."""
    path, run_dir, warns = resolve_checkpoint(args.path)
    warn(warns)
    data = read_manifest(path)
    parts = read_parts(path, data)
    if parts is not None and args.rank is None:
        s = parts_summary(path, data, run_dir, parts)
        if args.json:
            print_json(s)
        else:
            print_parts(s)
        bad = [r for r in s["parts"] if r["tensors"] is None]
        if bad:
            print(f"{PROG}: error: {path}: part(s) missing or unreadable: "
                  f"{', '.join(r['name'] for r in bad)}", file=sys.stderr)
            return 1
        return 0
    if parts is not None:
        s, m = part_summary(path, parts, args.rank)
        if run_dir:
            s["run_dir"] = shown(run_dir)
    else:
        no_rank_for_single(path, args.rank)
        m = parse_manifest("", tolerant=True, data=data)
        s = checkpoint_summary(path, m, run_dir)
    if args.json:
        print_json(dict(s, tensors=tensor_table(m)))
    else:
        print_checkpoint(s, tensor_table(m), not args.brief)
    return 0


def print_checkpoint(s: dict, tensors: dict, show_tensors: bool) -> None:
    """Print the summary ``s`` of a single-rank checkpoint or of one part; ``tensors`` is its
    :func:`~.summary.tensor_table`, listed in full if ``show_tensors``."""
    _print_header(s)
    r = s["ranks"]
    if s.get("part_of"):
        po = s["part_of"]
        print(f"part         rank {po['rank']} of {po['world_size']} ({po['name']}) of checkpoint "
              f"{po['checkpoint']}")
    elif r.get("world_size") == 1 and r.get("rank", 0) == 0:
        print("ranks        1 (single-process checkpoint)")
    elif "rank" in r:
        print(f"ranks        part of rank {r['rank']} of a checkpoint written by "
              f"{r.get('world_size', '?')} ranks")
    else:
        print("ranks        " + ", ".join(f"{k}={v}" for k, v in r.items()))
    files = ", ".join(f"{f} {human(n)}" for f, n in s["files"].items()) or "no data files"
    print(f"size         {human(s['disk_bytes'])} on disk; tensors {human(s['tensor_bytes'])} "
          f"in {len(tensors)} tensors ({files})")
    _print_state(s)
    if s["metrics"]:
        print("")
        _print_timings(s["metrics"])
    print("")
    print(f"tensors      {len(tensors)}: {_groups(s)}")
    if show_tensors:
        rows = [[name, e["dtype"], "[" + ", ".join(map(str, e["shape"])) + "]",
                 human(e["nbytes"]), e["file"], e["holds"]] for name, e in tensors.items()]
        for line in table(rows, ["NAME", "DTYPE", "SHAPE", "SIZE", "FILE", "HOLDS"], right={3}):
            print("  " + line)


def print_parts(s: dict) -> None:
    """Print the summary ``s`` of a checkpoint written by several ranks."""
    parts = s["parts"]
    world = len(parts)
    _print_header(s, "-")
    n_ok = sum(r["tensors"] is not None for r in parts)
    missing = f", {world - n_ok} MISSING or unreadable" if n_ok < world else ""
    print(f"ranks        {world} (written by {world} ranks, one part each: "
          f"{_names_span([r['name'] for r in parts])}{missing})")
    print(f"size         {human(s['disk_bytes'])} on disk; tensors {human(s['tensor_bytes'])} "
          f"in {s['tensor_count']} tensors, summed over {n_ok} part(s)")
    _print_layout(s["layout"])
    _print_state(s, f"  [rank {s['described_rank']}" + ("'s share]" if s["layout"]["shares"]
                                                        else "'s shards]"
                                                        if s["layout"].get("sharded") else "]"))
    print("")
    print("parts")
    rows = []
    for r in parts:
        status = (f"MISSING: {r['error']}" if r["tensors"] is None
                  else "INCONSISTENT" if r["problems"] else "ok")
        rows.append([str(r["rank"]), r["name"], "-" if r["step"] is None else str(r["step"]),
                     "-" if r["tensors"] is None else str(r["tensors"]),
                     human(r["tensor_bytes"]), human(r["disk_bytes"]), status])
    for line in table(rows, ["RANK", "PART", "STEP", "TENSORS", "TENSOR BYTES", "ON DISK",
                             "STATUS"], right={0, 2, 3, 4, 5}):
        print("  " + line)
    with_metrics = [r for r in parts if r["metrics"]]
    if with_metrics:
        print("")
        _print_rank_timings(with_metrics)
    print("")
    print(f"tensors      {s['tensor_count']} over {n_ok} part(s): {_groups(s)}")
    print(f"  one part's tensor table, timings and model: gockpt inspect {s['path']} --rank R")


def _print_layout(layout: dict) -> None:
    """The parallel layout of a checkpoint of several ranks."""
    n, split = layout["world_size"], layout["split"]
    sharded = layout.get("sharded")
    if layout["shares"]:
        what = "one replicated state" if not sharded else \
            "what the ranks hold alike (replicated tensors, HSDP's replicas of a shard)"
        print(f"layout       {what} in {n} shares: each rank copied, replayed and "
              f"wrote about 1/{n} of it; of its {layout['tensors']} parameters and optimizer "
              f"state tensors {len(split)} are split across parts, the others lie whole in one")
        for what, parts in list(split.items())[:4]:
            print(f"               {what}: across {parts} parts")
        if len(split) > 4:
            print(f"               ... and {len(split) - 4} more")
    elif layout["replicated"]:
        print(f"layout       replicated: every one of the {n} parts holds the whole state")
    elif not sharded:
        print(f"layout       per-rank state: each part holds its own rank's (loads on {n} ranks)")
    if sharded:
        print(f"{'and' if layout['shares'] else 'layout':<13}sharded (DTensor shards: FSDP2 / "
              f"tensor parallel; ZeRO partitions): {len(sharded)} "
              f"parameters in slices across the {n} parts,\n"
              "             their optimizer state sliced alike (the global index in the "
              f"manifest; loads on {n} ranks sharded alike)")
        for name, e in list(sharded.items())[:4]:
            print(f"               {name}: global shape {e['shape']}, {e['slices']} slices")
        if len(sharded) > 4:
            print(f"               ... and {len(sharded) - 4} more")


def _print_header(s: dict, none: str = "none") -> None:
    """The first lines of every inspect output (single- and multi-rank)."""
    where = f"  (latest of {s['run_dir']})" if s["run_dir"] else ""
    print(f"checkpoint   {s['path']}{where}")
    step = s["step"]
    span = ""
    if s["start_step"] is not None and step is not None:
        span = f"  (captured over steps {s['start_step']}..{step})"
    print(f"step         {step if step is not None else '-'}{span}")
    k = s["overlap_steps"]
    print(f"mode         {s['mode'] or '-'}" + (f", overlap_steps K={k}" if k is not None else ""))
    print(f"format       {s['format']} v{s['format_version']}, checksums: "
          f"{', '.join(s['checksums']) or none}")
    print(f"written      {date(mtime(s['path']))}")


def _print_state(s: dict, tag: str = "") -> None:
    """The model, optimizer, scheduler and extra_state lines, then the problems; each state
    line ends with ``tag`` (nothing but the problems without a described model)."""
    m = s["model"]
    if m is not None:
        tied = f", {len(m['aliases'])} tied alias(es)" if m["aliases"] else ""
        print(f"model        {m['params']} parameters ({m['param_elements']:,} elements, "
              f"{human(m['param_bytes'])}), {len(m['buffers'])} buffers{tied}{tag}")
        o = s["optimizer"]
        if o:
            groups = o.get("param_groups") or []
            lr = sorted({g.get("lr") for g in groups if isinstance(g.get("lr"), (int, float))})
            lrs = f", lr {', '.join(f'{x:g}' for x in lr)}" if lr else ""
            print(f"optimizer    {o['class']}, {len(groups)} param group(s){lrs}; per-element "
                  f"state {', '.join(o['aligned_state']) or 'none'} for {o['aligned_params']} "
                  f"parameters{tag}")
        print(f"scheduler    {'none' if s['scheduler'] is None else s['scheduler']}{tag}")
        print(f"extra_state  {'none' if s['extra_state'] is None else s['extra_state']}{tag}")
    for prob in s["problems"]:
        print(f"problem      {prob}")


def _print_timings(met: dict) -> None:
    """The timings block of one checkpoint's metrics."""
    print("timings")
    hooks = met.get("blocked_by_hook_s") or {}
    top = ", ".join(f"{h} {seconds(v)}" for h, v in
                    sorted(hooks.items(), key=lambda kv: -kv[1]) if v >= 5e-5) or "-"
    rows = [[label, seconds(met.get(key)), what or top] for key, label, what in _TIMINGS]
    for line in table(rows, ["", "seconds", ""], right={1})[1:]:
        print("  " + line)
    print(f"  state {human(met.get('state_bytes'))} (replayed {human(met.get('replayed_bytes'))}, "
          f"copied at F {human(met.get('copied_at_f_bytes'))}), "
          f"gradients {human(met.get('grad_bytes'))}, "
          f"self-check {met.get('self_check_blocks', '-')} block(s), "
          f"{met.get('self_check_mismatches', '-')} mismatch(es)")
    other = [f"{k} {human(v) if k.endswith('_bytes') else seconds(v) if k.endswith('_s') else v}"
             for k, v in met.items() if k not in _SHOWN and isinstance(v, (int, float, str))]
    if other:
        print(f"  other: {', '.join(other)}")


def _print_rank_timings(with_metrics: list) -> None:
    """The timings of several parts: a column per rank, or rank 0 and the max over many."""
    few = len(with_metrics) <= _MAX_RANK_COLUMNS
    first = with_metrics[0]["rank"]
    if few:
        print("timings (per rank)")
        header = [""] + [f"rank {r['rank']}" for r in with_metrics] + ["max"]
    else:
        print(f"timings (rank {first} and the max over {len(with_metrics)} ranks)")
        header = ["", f"rank {first}", "max", "max at"]
    rows = []
    for key, label, _what in _TIMINGS:
        vals = [r["metrics"].get(key) for r in with_metrics]
        nums = [(v, r["rank"]) for v, r in zip(vals, with_metrics) if isinstance(v, (int, float))]
        mx = max(nums) if nums else None
        if few:
            rows.append([label] + [seconds(v) for v in vals] + [seconds(mx[0]) if mx else "-"])
        else:
            rows.append([label, seconds(vals[0]), seconds(mx[0]) if mx else "-",
                         f"rank {mx[1]}" if mx else "-"])
    for line in table(rows, header, right=set(range(1, len(header)))):
        print("  " + line)
    mism = [r["metrics"].get("self_check_mismatches") for r in with_metrics]
    if any(isinstance(x, int) and x for x in mism):
        print("  self-check mismatches: " + ", ".join(
            f"rank {r['rank']} {x}" for r, x in zip(with_metrics, mism) if x))


def _groups(s: dict) -> str:
    return ", ".join(f"{g} {c['tensors']} ({human(c['bytes'])})" for g, c in s["groups"].items())


def _names_span(names: list) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]}"
