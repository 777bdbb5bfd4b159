"""The ``gockpt`` console tool: look at, check and convert checkpoints without writing Python.

Subcommands::

    gockpt inspect PATH [--rank R] [--json]   step, mode, tensors, sizes, ranks, timings
    gockpt verify  PATH [--all] [--json]      every checksum; names each bad file and tensor
    gockpt export  PATH --to {safetensors,torch} OUT [--rank R] [--force]
    gockpt list    DIR  [--json]              checkpoints, which is latest, ranks, leftovers
    gockpt clean   DIR                        remove leftovers of processes that died

``PATH`` is a checkpoint directory or a run directory (then: its latest checkpoint).

A checkpoint written by several ranks (see :mod:`gockpt.ranks`) is a directory whose top-level
manifest lists its parts (``"ranks": ["rank-00000", ...]``); each part is a complete
single-rank checkpoint directory inside it. ``inspect`` summarises the parts (``--rank R``
shows one part in full), ``verify`` checks every part and reports a listed part that is
missing or unreadable, ``export --rank R`` exports one rank's part (default rank 0).

Exit status: 0 success; 1 the checkpoint is bad (a checksum or file does not verify, the
manifest is corrupt, or data could not be read while exporting); 2 usage errors and paths that
do not exist or hold no checkpoint. Every error is one line on stderr.

Only :mod:`gockpt.storage`'s public functions touch the files, so this tool keeps working
when the data layout or the checksum scheme changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings
from typing import Optional, Sequence

import torch

from .. import storage
from ..storage import tree
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, GockptError

__all__ = ["main"]

PROG = "gockpt"

# Tensor entry fields that are not checksums (whatever else an entry holds is a checksum:
# "crc32" today, per-block crc32c tomorrow).
_ENTRY_FIELDS = {"file", "dtype", "shape", "offset", "nbytes"}


class UsageError(Exception):
    """Bad arguments, a path that does not exist or holds no checkpoint: exit status 2."""


class BadCheckpoint(Exception):
    """The checkpoint exists but is damaged or not what gockpt wrote: exit status 1."""


# ---------------------------------------------------------------------------------- helpers


def _human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _date(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _iso(ts: Optional[float]) -> Optional[str]:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _disk_usage(path: str) -> Optional[int]:
    """Bytes of the regular files under ``path`` (or of ``path`` itself if it is a file)."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
        total = 0
        for dirpath, _dirs, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    pass
        return total
    except OSError:
        return None


def _mtime(path: str) -> Optional[float]:
    # A checkpoint directory's mtime is that of the last entry created in it before the
    # atomic rename: its commit time.
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _table(rows, header, right=()) -> list:
    """Rows of strings as aligned text columns; column indices in ``right`` align right."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    out = []
    for r in [header] + rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def _resolve(path: str) -> tuple:
    """(checkpoint directory, run directory or None, warnings) for a checkpoint or run dir."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise UsageError(f"{path}: not a directory (give a checkpoint directory or a run "
                         "directory holding checkpoints)")
    norm = os.path.normpath(os.path.abspath(path))
    parent, base = os.path.split(norm)
    caught = []
    # A committed checkpoint directory is one that storage.resolve finds by name in its parent.
    try:
        return storage.resolve(parent, base), None, caught
    except CheckpointNotFoundError:
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            found = storage.resolve(path)
        except CheckpointNotFoundError as exc:
            raise UsageError(f"{path}: neither a gockpt checkpoint nor a run directory holding "
                             f"one ({_one_line(exc)})") from None
    caught = [_one_line(x.message) for x in w]
    return found, path, caught


def _read_manifest(path: str) -> dict:
    try:
        return storage.read_manifest(path)
    except CheckpointNotFoundError as exc:
        raise UsageError(_one_line(exc)) from None
    except CorruptCheckpointError as exc:
        raise BadCheckpoint(_one_line(exc)) from None


def _warn(msgs) -> None:
    for m in msgs:
        print(f"{PROG}: warning: {m}", file=sys.stderr)


def _tensor_refs(encoded, path: str, out: dict) -> dict:
    """Map each tensor key referenced by a gockpt.tree-encoded value to where it sits."""
    if isinstance(encoded, list):
        for i, v in enumerate(encoded):
            _tensor_refs(v, f"{path}[{i}]", out)
    elif isinstance(encoded, dict):
        tag = encoded.get(tree.TAG)
        if tag is None:
            for k, v in encoded.items():
                _tensor_refs(v, f"{path}[{k!r}]" if path else str(k), out)
        elif tag in ("tensor", "ndarray") and isinstance(encoded.get("k"), str):
            out[encoded["k"]] = path
        elif tag == "tuple" and isinstance(encoded.get("v"), list):
            _tensor_refs(encoded["v"], path, out)
        elif tag in ("dict", "odict") and isinstance(encoded.get("v"), list):
            for pair in encoded["v"]:
                if isinstance(pair, list) and len(pair) == 2:
                    key = pair[0] if not isinstance(pair[0], dict) else "<key>"
                    _tensor_refs(pair[1], f"{path}[{key!r}]", out)
    return out


def _roles(manifest: dict) -> dict:
    """Tensor name -> what it holds, for a person reading `inspect`."""
    roles = {}
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    params = model.get("params") if isinstance(model.get("params"), dict) else {}
    aliases = model.get("aliases") if isinstance(model.get("aliases"), dict) else {}
    tied = {}
    for alias, canon in aliases.items():
        tied.setdefault(canon, []).append(alias)
    for name, tname in params.items():
        extra = f" (tied: {', '.join(tied[name])})" if name in tied else ""
        roles[tname] = f"param {name}{extra}"
    small = manifest.get("small") if isinstance(manifest.get("small"), dict) else {}
    for section, label in (("model", "buffer"), ("optimizer", "optimizer"),
                           ("scheduler", "scheduler"), ("rng", "rng"),
                           ("extra_state", "extra_state")):
        for key, where in _tensor_refs(small.get(section), "", {}).items():
            roles[key] = f"{label} {where}".rstrip()
    # Optimizer index i is the i-th planned parameter (the plan lists the optimizer's
    # parameters first, in order); shown only where the shapes agree.
    entries = manifest.get("tensors", {})
    names = list(params)
    opt = manifest.get("optimizer") if isinstance(manifest.get("optimizer"), dict) else {}
    for idx, keys in (opt.get("aligned") or {}).items():
        for key in keys if isinstance(keys, list) else ():
            tname = f"optim/{idx}/{key}"
            role = f"optimizer state[{idx}][{key!r}]"
            try:
                pname = names[int(idx)]
                if entries[params[pname]]["shape"] == entries[tname]["shape"]:
                    role += f" of {pname}"
            except (ValueError, IndexError, KeyError, TypeError):
                pass
            roles[tname] = role
    return roles


class _Placeholders(dict):
    """Stand-ins for the tensors a tree decodes to, built from the manifest alone (no data read)."""

    def __init__(self, entries: dict):
        super().__init__()
        self._entries = entries

    def __contains__(self, key):
        return key in self._entries

    def __getitem__(self, key):
        e = self._entries[key]
        return torch.empty(e["shape"], dtype=storage.CODE_TO_DTYPE[e["dtype"]])


def _decode_meta(manifest: dict, section: str):
    """Decode ``small[section]`` without reading data; raises ValueError if malformed."""
    small = manifest.get("small")
    if not isinstance(small, dict) or section not in small:
        raise ValueError(f"no small/{section} section")
    return tree.decode(small[section], _Placeholders(manifest["tensors"]))


# ---------------------------------------------------------------------------------- ranks


def _part_names(path: str, manifest: dict) -> Optional[list]:
    """The part directory names of a checkpoint written by several ranks (None: one rank).

    Raises BadCheckpoint if the manifest's ``ranks`` list is malformed.
    """
    ranks = manifest.get("ranks")
    if ranks is None:
        return None
    if not isinstance(ranks, list) or not ranks:
        raise BadCheckpoint(f"{path}: manifest 'ranks' is {ranks!r:.60}, expected a non-empty "
                            "list of part directory names")
    for part in ranks:
        if not isinstance(part, str) or part in ("", ".", "..") or part.startswith(".") \
                or any(c in part for c in "/\\\0"):
            raise BadCheckpoint(f"{path}: invalid part name {part!r:.60} in the manifest")
    return ranks


def _parts(path: str, manifest: dict) -> Optional[list]:
    """One dict per listed rank: rank, name, path, manifest (None if unreadable), error,
    problems (inconsistencies with the top-level manifest). None for a single-rank checkpoint."""
    names = _part_names(path, manifest)
    if names is None:
        return None
    world = len(names)
    out = []
    for r, name in enumerate(names):
        sub = os.path.join(path, name)
        part = {"rank": r, "name": name, "path": os.path.abspath(sub), "manifest": None,
                "error": None, "problems": []}
        try:
            part["manifest"] = m = storage.read_manifest(sub)
        except CheckpointNotFoundError:
            part["error"] = f"directory {name}/ does not exist"
        except CorruptCheckpointError as exc:
            part["error"] = _one_line(exc)
        else:
            if m.get("ranks") is not None:
                part["problems"].append(f"{name}: is itself a multi-rank checkpoint")
            if m.get("rank", r) != r:
                part["problems"].append(f"{name}: its manifest says rank {m.get('rank')!r}, "
                                        f"listed as rank {r}")
            if m.get("world_size", world) != world:
                part["problems"].append(f"{name}: its manifest says world_size "
                                        f"{m.get('world_size')!r}, the checkpoint has "
                                        f"{world} parts")
            if manifest.get("step") is not None and m.get("step") != manifest.get("step"):
                part["problems"].append(f"{name}: step {m.get('step')!r}, the checkpoint's step "
                                        f"is {manifest.get('step')!r}")
        out.append(part)
    return out


def _world_problems(manifest: dict, parts: list) -> list:
    ws = manifest.get("world_size")
    if ws is not None and ws != len(parts):
        return [f"manifest world_size is {ws!r} but it lists {len(parts)} parts"]
    return []


def _select_part(path: str, parts: list, rank: int) -> dict:
    """The readable part of ``rank``: UsageError if out of range, BadCheckpoint if unreadable."""
    if not 0 <= rank < len(parts):
        raise UsageError(f"{path} has parts for ranks 0..{len(parts) - 1}; --rank {rank} asked")
    part = parts[rank]
    if part["manifest"] is None:
        raise BadCheckpoint(f"{path}: part {part['name']} (rank {rank}) is missing or "
                            f"unreadable: {part['error']}")
    return part


def _no_rank_for_single(path: str, rank: Optional[int]) -> None:
    if rank not in (None, 0):
        raise UsageError(f"{path} was written by a single process (rank 0 only); "
                         f"--rank {rank} asked")


# ---------------------------------------------------------------------------------- inspect


def _summary(path: str, manifest: dict, run_dir: Optional[str]) -> dict:
    entries = manifest["tensors"]
    files = {}
    for e in entries.values():
        files[e["file"]] = files.get(e["file"], 0) + e["nbytes"]
    extra = {k: e[k] for e in entries.values() for k in e if k not in _ENTRY_FIELDS}
    checksums = sorted(k for k in extra if any(w in k.lower() for w in ("crc", "sum", "hash")))
    if "block_bytes" in extra and checksums:  # per-block checksums (storage format v2)
        checksums = [f"{c} per {_human(extra['block_bytes'])} block" for c in checksums]
    checksums = checksums or sorted(extra)
    groups = {}
    for name, e in entries.items():
        g = name.split("/", 1)[0] if "/" in name else "(other)"
        c = groups.setdefault(g, {"tensors": 0, "bytes": 0})
        c["tensors"] += 1
        c["bytes"] += e["nbytes"]

    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    params = model.get("params") if isinstance(model.get("params"), dict) else {}
    aliases = model.get("aliases") if isinstance(model.get("aliases"), dict) else {}
    param_elems = sum(_numel(entries[t]["shape"]) for t in params.values() if t in entries)
    param_bytes = sum(entries[t]["nbytes"] for t in params.values() if t in entries)
    problems = []
    try:
        buffers = _decode_meta(manifest, "model")
        buffer_names = list(buffers) if isinstance(buffers, dict) else []
    except (ValueError, KeyError, TypeError) as exc:
        buffer_names, buffers = [], None
        problems.append(f"small/model: {_one_line(exc)}")
    opt_info = None
    if isinstance(manifest.get("optimizer"), dict):
        opt = manifest["optimizer"]
        opt_info = {"class": opt.get("class"),
                    "aligned_state": sorted({k for ks in (opt.get("aligned") or {}).values()
                                             for k in ks}),
                    "aligned_params": len(opt.get("aligned") or {})}
        try:
            osd = _decode_meta(manifest, "optimizer")
            opt_info["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} | {"params": len(g["params"])}
                for g in osd["param_groups"]]
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"small/optimizer: {_one_line(exc)}")
    sched = extra = None
    try:
        s = _decode_meta(manifest, "scheduler")
        sched = None if s is None else sorted(s) if isinstance(s, dict) else type(s).__name__
    except (ValueError, KeyError, TypeError):
        pass
    try:
        x = _decode_meta(manifest, "extra_state")
        extra = None if x is None else sorted(map(str, x)) if isinstance(x, dict) \
            else type(x).__name__
    except (ValueError, KeyError, TypeError):
        pass

    # The format holds one process's state; rank fields are shown if a writer adds them.
    ranks = {k: manifest[k] for k in ("rank", "world_size", "ranks") if k in manifest}
    return {
        **_identity(path, run_dir, manifest),
        "ranks": ranks or {"world_size": 1},
        "disk_bytes": _disk_usage(path),
        "tensor_bytes": sum(e["nbytes"] for e in entries.values()),
        "files": files,
        "checksums": checksums,
        "groups": groups,
        "model": {"params": len(params), "param_elements": param_elems,
                  "param_bytes": param_bytes, "buffers": buffer_names,
                  "aliases": dict(aliases)},
        "optimizer": opt_info,
        "scheduler": sched,
        "extra_state": extra,
        "metrics": manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else None,
        "problems": problems,
    }


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fmt_s(x) -> str:
    return f"{x:.4f}s" if isinstance(x, (int, float)) else "-"


def _identity(path: str, run_dir, manifest: dict) -> dict:
    """The fields every summary starts with (single- and multi-rank)."""
    return {
        "path": os.path.abspath(path),
        "run_dir": os.path.abspath(run_dir) if run_dir else None,
        "format": manifest.get("format"),
        "format_version": manifest.get("format_version"),
        "step": manifest.get("step"),
        "start_step": manifest.get("start_step"),
        "mode": manifest.get("mode"),
        "overlap_steps": manifest.get("overlap_steps"),
        "written": _iso(_mtime(path)),
    }


def _print_header(s: dict, none: str = "none") -> None:
    """The first lines of every inspect output (single- and multi-rank)."""
    p = print
    where = f"  (latest of {s['run_dir']})" if s["run_dir"] else ""
    p(f"checkpoint   {s['path']}{where}")
    step = s["step"]
    span = ""
    if s["start_step"] is not None and step is not None:
        span = f"  (captured over steps {s['start_step']}..{step})"
    p(f"step         {step if step is not None else '-'}{span}")
    k = s["overlap_steps"]
    p(f"mode         {s['mode'] or '-'}" + (f", overlap_steps K={k}" if k is not None else ""))
    p(f"format       {s['format']} v{s['format_version']}, checksums: "
      f"{', '.join(s['checksums']) or none}")
    p(f"written      {_date(_mtime(s['path']))}")


def _print_inspect(s: dict, manifest: dict, show_tensors: bool) -> None:
    p = print
    _print_header(s)
    r = s["ranks"]
    if s.get("part_of"):
        po = s["part_of"]
        p(f"part         rank {po['rank']} of {po['world_size']} ({po['name']}) of checkpoint "
          f"{po['checkpoint']}")
    elif r.get("world_size") == 1 and r.get("rank", 0) == 0 and not r.get("ranks"):
        p("ranks        1 (single-process checkpoint)")
    elif "rank" in r and "ranks" not in r:
        p(f"ranks        part of rank {r['rank']} of a checkpoint written by "
          f"{r.get('world_size', '?')} ranks")
    else:
        p("ranks        " + ", ".join(f"{k}={v}" for k, v in r.items()))
    files = ", ".join(f"{f} {_human(n)}" for f, n in s["files"].items()) or "no data files"
    p(f"size         {_human(s['disk_bytes'])} on disk; tensors {_human(s['tensor_bytes'])} "
      f"in {len(manifest['tensors'])} tensors ({files})")
    m = s["model"]
    tied = f", {len(m['aliases'])} tied alias(es)" if m["aliases"] else ""
    p(f"model        {m['params']} parameters ({m['param_elements']:,} elements, "
      f"{_human(m['param_bytes'])}), {len(m['buffers'])} buffers{tied}")
    o = s["optimizer"]
    if o:
        groups = o.get("param_groups") or []
        lr = sorted({g.get("lr") for g in groups if isinstance(g.get("lr"), (int, float))})
        lrs = f", lr {', '.join(f'{x:g}' for x in lr)}" if lr else ""
        p(f"optimizer    {o['class']}, {len(groups)} param group(s){lrs}; per-element state "
          f"{', '.join(o['aligned_state']) or 'none'} for {o['aligned_params']} parameters")
    p(f"scheduler    {'none' if s['scheduler'] is None else s['scheduler']}")
    p(f"extra_state  {'none' if s['extra_state'] is None else s['extra_state']}")
    for prob in s["problems"]:
        p(f"problem      {prob}")

    met = s["metrics"]
    if met:
        p("")
        p("timings")
        hooks = met.get("blocked_by_hook_s") or {}
        top = ", ".join(f"{h} {_fmt_s(v)}" for h, v in
                        sorted(hooks.items(), key=lambda kv: -kv[1]) if v >= 5e-5) or "-"
        rows = [
            ("training blocked", _fmt_s(met.get("blocked_s")), top),
            ("copy", _fmt_s(met.get("copy_s")), "device-to-host copies (cumulative)"),
            ("replay", _fmt_s(met.get("replay_s")), "optimizer replay on host"),
            ("persist", _fmt_s(met.get("persist_s")), "write + fsync + commit"),
            ("time to staged", _fmt_s(met.get("time_to_staged_s")), "start to state in host memory"),
            ("time to durable", _fmt_s(met.get("time_to_durable_s")), "start to committed on disk"),
            ("step time", _fmt_s(met.get("step_time_s")), "median training step"),
        ]
        for line in _table([list(r) for r in rows], ["", "seconds", ""], right={1})[1:]:
            p("  " + line)
        p(f"  state {_human(met.get('state_bytes'))}, gradients {_human(met.get('grad_bytes'))}, "
          f"self-check {met.get('self_check_blocks', '-')} block(s), "
          f"{met.get('self_check_mismatches', '-')} mismatch(es)")
        shown = {"start_step", "final_step", "mode", "overlap_steps", "state_bytes", "grad_bytes",
                 "blocked_s", "blocked_by_hook_s", "copy_s", "replay_s", "persist_s",
                 "time_to_staged_s", "time_to_durable_s", "self_check_blocks",
                 "self_check_mismatches", "step_time_s"}
        other = [f"{k} {_human(v) if k.endswith('_bytes') else _fmt_s(v) if k.endswith('_s') else v}"
                 for k, v in met.items() if k not in shown and isinstance(v, (int, float, str))]
        if other:
            p(f"  other: {', '.join(other)}")

    p("")
    groups = ", ".join(f"{g} {c['tensors']} ({_human(c['bytes'])})" for g, c in s["groups"].items())
    p(f"tensors      {len(manifest['tensors'])}: {groups}")
    if show_tensors:
        roles = _roles(manifest)
        rows = [[name, e["dtype"], "[" + ", ".join(map(str, e["shape"])) + "]",
                 _human(e["nbytes"]), e["file"], roles.get(name, "")]
                for name, e in manifest["tensors"].items()]
        for line in _table(rows, ["NAME", "DTYPE", "SHAPE", "SIZE", "FILE", "HOLDS"], right={3}):
            p("  " + line)


_TIMINGS = [  # (metrics key, label, what)
    ("blocked_s", "training blocked", ""),
    ("copy_s", "copy", "device-to-host copies (cumulative)"),
    ("replay_s", "replay", "optimizer replay on host"),
    ("persist_s", "persist", "write + fsync + commit"),
    ("time_to_staged_s", "time to staged", "start to state in host memory"),
    ("time_to_durable_s", "time to durable", "start to committed on disk"),
    ("step_time_s", "step time", "median training step"),
]

# Up to this many ranks `inspect` shows one timings column per rank; beyond, rank 0 and the max.
_MAX_RANK_COLUMNS = 8


def _multi_summary(path: str, manifest: dict, run_dir: Optional[str], parts: list) -> dict:
    """`inspect` of a checkpoint written by several ranks: the parts, sizes summed over them,
    and what the model/optimizer look like (from the lowest readable rank)."""
    world = len(parts)
    part_rows, ref = [], None
    groups, files = {}, {}
    n_tensors = tensor_bytes = 0
    problems = _world_problems(manifest, parts)
    for part in parts:
        m = part["manifest"]
        row = {"rank": part["rank"], "name": part["name"], "path": part["path"],
               "ok": m is not None and not part["problems"], "error": part["error"],
               "problems": list(part["problems"]), "step": None, "tensors": None,
               "tensor_bytes": None, "disk_bytes": _disk_usage(part["path"]), "metrics": None}
        problems.extend(part["problems"])
        if m is None:
            problems.append(f"part {part['name']} (rank {part['rank']}) is missing or "
                            f"unreadable: {part['error']}")
        else:
            ps = _summary(part["path"], m, None)
            if ref is None:
                ref = (part["rank"], ps)
            row.update(step=m.get("step"), tensors=len(m["tensors"]),
                       tensor_bytes=ps["tensor_bytes"], metrics=ps["metrics"])
            n_tensors += len(m["tensors"])
            tensor_bytes += ps["tensor_bytes"]
            for f, n in ps["files"].items():
                files[f"{part['name']}/{f}"] = n
            for g, c in ps["groups"].items():
                acc = groups.setdefault(g, {"tensors": 0, "bytes": 0})
                acc["tensors"] += c["tensors"]
                acc["bytes"] += c["bytes"]
            problems.extend(f"{part['name']}: {x}" for x in ps["problems"])
        part_rows.append(row)
    ref_rank, rs = ref if ref is not None else (None, {})
    return {
        **_identity(path, run_dir, manifest),
        "ranks": {"world_size": manifest.get("world_size", world), "ranks": list(
            p["name"] for p in parts)},
        "disk_bytes": _disk_usage(path),
        "tensor_count": n_tensors,
        "tensor_bytes": tensor_bytes,
        "files": files,
        "checksums": rs.get("checksums", []),
        "groups": groups,
        "described_rank": ref_rank,
        "model": rs.get("model"),
        "optimizer": rs.get("optimizer"),
        "scheduler": rs.get("scheduler"),
        "extra_state": rs.get("extra_state"),
        "metrics": None,
        "parts": part_rows,
        "problems": problems,
    }


def _print_multi(s: dict) -> None:
    p = print
    parts = s["parts"]
    world = len(parts)
    _print_header(s, "-")
    n_ok = sum(r["tensors"] is not None for r in parts)
    missing = f", {world - n_ok} MISSING or unreadable" if n_ok < world else ""
    p(f"ranks        {world} (written by {world} ranks, one part each: "
      f"{_names_span([r['name'] for r in parts])}{missing})")
    p(f"size         {_human(s['disk_bytes'])} on disk; tensors {_human(s['tensor_bytes'])} in "
      f"{s['tensor_count']} tensors, summed over {n_ok} part(s)")
    ref = s["described_rank"]
    m = s["model"]
    if m is not None:
        tied = f", {len(m['aliases'])} tied alias(es)" if m["aliases"] else ""
        p(f"model        {m['params']} parameters ({m['param_elements']:,} elements, "
          f"{_human(m['param_bytes'])}), {len(m['buffers'])} buffers{tied}  [rank {ref}]")
    o = s["optimizer"]
    if o:
        groups = o.get("param_groups") or []
        lr = sorted({g.get("lr") for g in groups if isinstance(g.get("lr"), (int, float))})
        lrs = f", lr {', '.join(f'{x:g}' for x in lr)}" if lr else ""
        p(f"optimizer    {o['class']}, {len(groups)} param group(s){lrs}; per-element state "
          f"{', '.join(o['aligned_state']) or 'none'} for {o['aligned_params']} parameters"
          f"  [rank {ref}]")
    if ref is not None:
        p(f"scheduler    {'none' if s['scheduler'] is None else s['scheduler']}  [rank {ref}]")
        p(f"extra_state  {'none' if s['extra_state'] is None else s['extra_state']}  [rank {ref}]")
    for prob in s["problems"]:
        p(f"problem      {prob}")

    p("")
    p("parts")
    rows = []
    for r in parts:
        if r["tensors"] is None:
            status = f"MISSING: {r['error']}"
        elif r["problems"]:
            status = "INCONSISTENT"
        else:
            status = "ok"
        rows.append([str(r["rank"]), r["name"], "-" if r["step"] is None else str(r["step"]),
                     "-" if r["tensors"] is None else str(r["tensors"]),
                     _human(r["tensor_bytes"]), _human(r["disk_bytes"]), status])
    for line in _table(rows, ["RANK", "PART", "STEP", "TENSORS", "TENSOR BYTES", "ON DISK",
                              "STATUS"], right={0, 2, 3, 4, 5}):
        p("  " + line)

    with_metrics = [r for r in parts if r["metrics"]]
    if with_metrics:
        p("")
        if len(with_metrics) <= _MAX_RANK_COLUMNS:
            p("timings (per rank)")
            header = [""] + [f"rank {r['rank']}" for r in with_metrics] + ["max"]
        else:
            p(f"timings (rank {with_metrics[0]['rank']} and the max over {len(with_metrics)} "
              "ranks)")
            header = ["", f"rank {with_metrics[0]['rank']}", "max", "max at"]
        trows = []
        for key, label, _what in _TIMINGS:
            vals = [r["metrics"].get(key) for r in with_metrics]
            nums = [(v, r["rank"]) for v, r in zip(vals, with_metrics)
                    if isinstance(v, (int, float))]
            mx = max(nums) if nums else None
            if len(with_metrics) <= _MAX_RANK_COLUMNS:
                trows.append([label] + [_fmt_s(v) for v in vals] +
                             [_fmt_s(mx[0]) if mx else "-"])
            else:
                trows.append([label, _fmt_s(vals[0]), _fmt_s(mx[0]) if mx else "-",
                              f"rank {mx[1]}" if mx else "-"])
        for line in _table(trows, header, right=set(range(1, len(header)))):
            p("  " + line)
        mism = [r["metrics"].get("self_check_mismatches") for r in with_metrics]
        if any(isinstance(x, int) and x for x in mism):
            p("  self-check mismatches: " + ", ".join(
                f"rank {r['rank']} {x}" for r, x in zip(with_metrics, mism) if x))

    p("")
    groups = ", ".join(f"{g} {c['tensors']} ({_human(c['bytes'])})" for g, c in s["groups"].items())
    p(f"tensors      {s['tensor_count']} over {n_ok} part(s): {groups}")
    p(f"  one part's tensor table, timings and model: gockpt inspect {s['path']} --rank R")


def _names_span(names: list) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]}"


def _inspect_part(path: str, parts: list, rank: int) -> tuple:
    """(summary, manifest) of one part, marked with the checkpoint it belongs to."""
    part = _select_part(path, parts, rank)
    s = _summary(part["path"], part["manifest"], None)
    s["part_of"] = {"checkpoint": os.path.abspath(path), "rank": rank, "name": part["name"],
                    "world_size": len(parts)}
    s["problems"] = part["problems"] + s["problems"]
    return s, part["manifest"]


def cmd_inspect(args) -> int:
    path, run_dir, warns = _resolve(args.path)
    _warn(warns)
    manifest = _read_manifest(path)
    parts = _parts(path, manifest)
    if parts is not None and args.rank is None:
        s = _multi_summary(path, manifest, run_dir, parts)
        if args.json:
            print(json.dumps(s, indent=2, default=str))
        else:
            _print_multi(s)
        bad = [r for r in s["parts"] if r["tensors"] is None]
        if bad:
            print(f"{PROG}: error: {path}: part(s) missing or unreadable: "
                  f"{', '.join(r['name'] for r in bad)}", file=sys.stderr)
            return 1
        return 0
    if parts is not None:
        s, manifest = _inspect_part(path, parts, args.rank)
        if run_dir:
            s["run_dir"] = os.path.abspath(run_dir)
    else:
        _no_rank_for_single(path, args.rank)
        s = _summary(path, manifest, run_dir)
    if args.json:
        s["tensors"] = {name: dict(e, holds=r) for (name, e), r in
                        zip(manifest["tensors"].items(),
                            (_roles(manifest).get(n, "") for n in manifest["tensors"]))}
        print(json.dumps(s, indent=2, default=str))
    else:
        _print_inspect(s, manifest, not args.brief)
    return 0


# ---------------------------------------------------------------------------------- verify


def _verify_one(path: str, *, parts: bool = True) -> dict:
    """Check every tensor of ``path`` one by one; never stops at the first bad one.

    A checkpoint written by several ranks is checked part by part (``parts=False``: only this
    directory, as for a part itself)."""
    result = {"path": os.path.abspath(path), "step": None, "ok": False, "tensors": 0,
              "bytes": 0, "bad": [], "problems": []}
    try:
        manifest = storage.read_manifest(path)
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        result["problems"].append(_one_line(exc))
        return result
    result["step"] = manifest.get("step")
    if parts and manifest.get("ranks") is not None:
        return _verify_parts(path, manifest, result)
    entries = manifest["tensors"]
    small = {}
    for name, e in entries.items():
        try:
            t = storage.read_tensors(path, manifest, names=[name], verify=True)[name]
        except CorruptCheckpointError as exc:
            result["bad"].append({"tensor": name, "file": e.get("file"), "error": _one_line(exc)})
            continue
        except OSError as exc:
            result["bad"].append({"tensor": name, "file": e.get("file"),
                                  "error": f"cannot read: {_one_line(exc)}"})
            continue
        result["tensors"] += 1
        result["bytes"] += e["nbytes"]
        if name.startswith("small/"):
            small[name] = t

    # Beyond checksums: every tensor the manifest refers to exists and the small state decodes.
    model = manifest.get("model")
    if isinstance(model, dict):
        params = model.get("params") or {}
        for pname, tname in params.items():
            if tname not in entries:
                result["problems"].append(f"parameter {pname!r} refers to missing tensor {tname!r}")
        for alias, canon in (model.get("aliases") or {}).items():
            if canon not in params:
                result["problems"].append(f"tied alias {alias!r} refers to unknown parameter "
                                          f"{canon!r}")
    opt = manifest.get("optimizer")
    if isinstance(opt, dict):
        for idx, keys in (opt.get("aligned") or {}).items():
            for key in keys:
                if f"optim/{idx}/{key}" not in entries:
                    result["problems"].append(f"optimizer state refers to missing tensor "
                                              f"'optim/{idx}/{key}'")
    bad_names = {b["tensor"] for b in result["bad"]}
    if isinstance(manifest.get("small"), dict):
        for section, enc in manifest["small"].items():
            refs = _tensor_refs(enc, "", {})
            if any(k in bad_names for k in refs):
                continue  # already reported as a bad tensor
            try:
                tree.decode(enc, small)
            except (ValueError, KeyError, TypeError) as exc:
                result["problems"].append(f"small/{section} does not decode: {_one_line(exc)}")
    result["ok"] = not result["bad"] and not result["problems"]
    return result


def _verify_parts(path: str, manifest: dict, result: dict) -> dict:
    """Verify every part of a checkpoint written by several ranks into ``result``.

    Bad tensors are named with their part (``file`` is ``rank-00001/data.safetensors``,
    ``rank`` is 1); a listed part whose directory or manifest is gone or unreadable is a
    ``missing`` entry and fails the checkpoint."""
    result.update(world_size=None, parts=[], missing=[])
    try:
        parts = _parts(path, manifest)
    except BadCheckpoint as exc:
        result["problems"].append(str(exc))
        return result
    result["world_size"] = len(parts)
    result["problems"].extend(_world_problems(manifest, parts))
    for part in parts:
        name = part["name"]
        row = {"rank": part["rank"], "name": name, "path": part["path"], "ok": False,
               "tensors": 0, "bytes": 0, "bad": 0, "problems": 0}
        result["parts"].append(row)
        if part["manifest"] is None:
            row["error"] = part["error"]
            result["missing"].append({"rank": part["rank"], "part": name,
                                      "error": part["error"]})
            continue
        sub = _verify_one(part["path"], parts=False)
        for b in sub["bad"]:
            result["bad"].append(dict(b, file=f"{name}/{b['file']}", rank=part["rank"]))
        probs = part["problems"] + [f"{name}: {x}" for x in sub["problems"]]
        result["problems"].extend(probs)
        result["tensors"] += sub["tensors"]
        result["bytes"] += sub["bytes"]
        row.update(ok=sub["ok"] and not part["problems"], tensors=sub["tensors"],
                   bytes=sub["bytes"], bad=len(sub["bad"]), problems=len(probs))
    result["ok"] = not result["bad"] and not result["problems"] and not result["missing"]
    return result


def _print_verify(r: dict, n_total: Optional[int] = None) -> None:
    step = f" (step {r['step']})" if r["step"] is not None else ""
    ranks = f"{r['world_size']} ranks, " if r.get("world_size") else ""
    if r["ok"]:
        print(f"OK       {r['path']}{step}: {ranks}{r['tensors']} tensors, {_human(r['bytes'])}, "
              "all checksums match")
        return
    for m in r.get("missing", ()):
        print(f"MISSING  part {m['part']} (rank {m['rank']} of {r['world_size']}): {m['error']}")
    for b in r["bad"]:
        err = b["error"]
        if repr(b["tensor"]) not in err or str(b["file"]) not in err:
            err = f"tensor {b['tensor']!r} in file {b['file']!r}: {err}"
        print(f"CORRUPT  {err}")
    for prob in r["problems"]:
        print(f"CORRUPT  {prob}")
    total = r["tensors"] + len(r["bad"])
    if r["step"] is None and not total:
        print(f"FAILED   {r['path']}: the manifest is unreadable; no tensor could be checked")
        return
    missing = r.get("missing") or []
    where = ""
    if r.get("parts"):
        checked = len(r["parts"]) - len(missing)
        where = f" in {checked} of {r['world_size']} part(s)"
        by_part = [f"{p['name']} {p['bad']}" for p in r["parts"] if p["bad"]]
        if by_part:
            where += f" ({', '.join(by_part)})"
    print(f"FAILED   {r['path']}{step}: {len(r['bad'])} of {total} tensors bad{where}"
          + (f", {len(missing)} part(s) missing or unreadable" if missing else "")
          + (f", {len(r['problems'])} other problem(s)" if r["problems"] else ""))


def cmd_verify(args) -> int:
    if args.all:
        if not os.path.isdir(args.path):
            raise UsageError(f"{args.path}: not a directory")
        names = storage.list_checkpoints(args.path)
        if not names:
            raise UsageError(f"{args.path}: no committed checkpoints to verify")
        paths = [os.path.join(args.path, n) for n in names]
    else:
        path, _run, warns = _resolve(args.path)
        _warn(warns)
        paths = [path]
    results = []
    for p in paths:
        r = _verify_one(p)
        results.append(r)
        if not args.json:
            _print_verify(r)
    ok = all(r["ok"] for r in results)
    if args.json:
        print(json.dumps(results if args.all else results[0], indent=2))
    else:
        for r in results:
            if not r["ok"]:
                print(f"{PROG}: verification failed: {r['path']}", file=sys.stderr)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------- export


def _model_state(path: str, manifest: dict, tensors: dict) -> tuple:
    """(state_dict, tied aliases) of the model; tied names share their canonical tensor."""
    try:
        params = manifest["model"]["params"]
        aliases = manifest["model"].get("aliases") or {}
        small = tree.decode(manifest["small"]["model"], tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadCheckpoint(f"{path}: manifest has no usable model section ({_one_line(exc)}); "
                            "is this a checkpoint written by gockpt.Checkpointer?") from None
    values = {name: tensors[tname] for name, tname in params.items()}
    values.update({alias: values[canon] for alias, canon in aliases.items() if canon in values})
    values.update(small)
    # Group names by owning module in order of first appearance (params come in optimizer
    # order, buffers after them): close to model.state_dict()'s order; load_state_dict ignores it.
    order = {}
    for name in list(params) + list(aliases) + list(small):
        order.setdefault(name.rsplit(".", 1)[0] if "." in name else "", len(order))
    names = sorted(values, key=lambda n: order[n.rsplit(".", 1)[0] if "." in n else ""])
    sd = {n: values[n] for n in names}
    return sd, dict(aliases)


def _optimizer_state(path: str, manifest: dict, tensors: dict) -> dict:
    try:
        osd = tree.decode(manifest["small"]["optimizer"], tensors)
        state = osd["state"]
        for idx, keys in (manifest.get("optimizer") or {}).get("aligned", {}).items():
            for key in keys:
                state.setdefault(int(idx), {})[key] = tensors[f"optim/{idx}/{key}"]
        return {"state": {i: state[i] for i in sorted(state)},
                "param_groups": osd["param_groups"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise BadCheckpoint(f"{path}: manifest has no usable optimizer section "
                            f"({_one_line(exc)})") from None


def _atomic_write(out: str, write) -> None:
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise UsageError(f"{out}: directory {d} does not exist")
    tmp = os.path.join(d, f".{os.path.basename(out)}.partial-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def cmd_export(args) -> int:
    if os.path.isdir(args.out):
        raise UsageError(f"{args.out}: is a directory; give the output file name")
    if os.path.exists(args.out) and not args.force:
        raise UsageError(f"{args.out}: exists; pass --force to overwrite it")
    if args.to == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise UsageError("--to safetensors needs the safetensors package "
                             "(pip install safetensors)") from None
    path, _run, warns = _resolve(args.path)
    _warn(warns)
    manifest = _read_manifest(path)
    parts = _parts(path, manifest)
    source = ""
    meta_ranks = {}
    if parts is not None:
        rank = 0 if args.rank is None else args.rank
        part = _select_part(path, parts, rank)
        if part["problems"]:
            raise BadCheckpoint(f"{path}: {'; '.join(part['problems'])}")
        _warn([f"{path}: part {q['name']} (rank {q['rank']}) is missing or unreadable; "
               f"exporting rank {rank}'s part anyway" for q in parts if q["manifest"] is None])
        source = f" (rank {rank} of {len(parts)}, part {part['name']})"
        meta_ranks = {"gockpt_rank": str(rank), "gockpt_world_size": str(len(parts))}
        path, manifest = part["path"], part["manifest"]
    else:
        _no_rank_for_single(path, args.rank)
    try:
        tensors = storage.read_tensors(path, manifest, verify=True)
    except CorruptCheckpointError as exc:
        raise BadCheckpoint(_one_line(exc)) from None
    sd, aliases = _model_state(path, manifest, tensors)
    step = manifest.get("step")
    notes = []
    if args.to == "safetensors":
        out = {}
        for name, v in sd.items():
            if not isinstance(v, torch.Tensor):
                notes.append(f"skipped {name!r}: not a tensor ({type(v).__name__})")
                continue
            # safetensors refuses tensors that share memory: tied names get their own copy.
            out[name] = v.clone() if name in aliases else v.contiguous()
        for alias, canon in aliases.items():
            notes.append(f"tied parameter {alias!r} written as a separate copy of {canon!r}")
        meta = {"format": "pt", "gockpt_step": str(step), "gockpt_mode": str(manifest.get("mode")),
                "gockpt_source": os.path.abspath(path), **meta_ranks}
        _atomic_write(args.out, lambda tmp: save_file(out, tmp, metadata=meta))
        written = out
        what = "model state_dict"
    else:
        obj = {"model": sd, "step": step}
        if meta_ranks:
            obj["rank"], obj["world_size"] = rank, len(parts)
        if manifest.get("optimizer") is not None:
            obj["optimizer"] = _optimizer_state(path, manifest, tensors)
        try:
            sched = tree.decode(manifest["small"]["scheduler"], tensors)
        except (KeyError, TypeError, ValueError):
            sched = None
        if sched is not None:
            obj["scheduler"] = sched
        _atomic_write(args.out, lambda tmp: torch.save(obj, tmp))
        written = {n: v for n, v in sd.items() if isinstance(v, torch.Tensor)}
        what = "model state_dict" + (" + optimizer state_dict" if "optimizer" in obj else "") \
            + (" + scheduler" if "scheduler" in obj else "")
    nbytes = sum(t.numel() * t.element_size() for t in written.values())
    print(f"wrote {args.out}: {what} of step {step} from {os.path.abspath(path)}{source} "
          f"({len(written)} model tensors, {_human(nbytes)})")
    for n in notes:
        print(f"note: {n}")
    return 0


# ---------------------------------------------------------------------------------- list


def _list_rows(root: str) -> list:
    names = storage.list_checkpoints(root)
    latest = None
    latest_note = None
    if names:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                latest = os.path.basename(storage.resolve(root))
            except CheckpointNotFoundError:
                latest = None
        if w:
            latest_note = "newest; the latest pointer is missing or stale"
    rows = []
    for name in names:
        path = os.path.join(root, name)
        row = {"name": name, "path": os.path.abspath(path), "step": None, "world_size": None,
               "bytes": _disk_usage(path), "date": _iso(_mtime(path)), "_mtime": _mtime(path),
               "latest": name == latest, "status": "committed"}
        try:
            manifest = storage.read_manifest(path)
            row["step"] = manifest.get("step")
            row["world_size"] = 1
            names_ = _part_names(path, manifest)
            if names_ is not None:
                row["world_size"] = len(names_)
                # Cheap: a part's manifest is its commit mark; `verify` reads the parts.
                gone = [n for n in names_
                        if not os.path.isfile(os.path.join(path, n, storage.MANIFEST_FILE))]
                if gone:
                    row["status"] = "missing part"
                    row["error"] = f"part(s) missing: {', '.join(gone)}"
        except (CorruptCheckpointError, CheckpointNotFoundError, BadCheckpoint) as exc:
            row["status"] = "corrupt manifest"
            row["error"] = _one_line(exc)
        if row["latest"] and latest_note:
            row["note"] = latest_note
        rows.append(row)
    try:
        entries = sorted(os.listdir(root))
    except OSError as exc:
        raise UsageError(f"{root}: cannot list: {exc.strerror or exc}") from None
    for name in entries:
        if name.startswith(storage.TMP_PREFIX):
            path = os.path.join(root, name)
            rows.append({"name": name, "path": os.path.abspath(path), "step": None,
                         "world_size": None, "bytes": _disk_usage(path), "date": _iso(_mtime(path)),
                         "_mtime": _mtime(path), "latest": False, "status": "incomplete"})
    return rows


def cmd_list(args) -> int:
    root = args.dir
    if not os.path.exists(root):
        raise UsageError(f"{root}: no such file or directory")
    if not os.path.isdir(root):
        raise UsageError(f"{root}: not a directory")
    rows = _list_rows(root)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
                         indent=2))
        return 0
    committed = [r for r in rows if r["status"] != "incomplete"]
    if not committed:
        hint = ""
        try:
            storage.read_manifest(root)
            hint = f" ({root} is itself a checkpoint: try `gockpt inspect {root}`)"
        except GockptError:
            pass
        print(f"no committed checkpoints in {root}{hint}")
    table = []
    for r in rows:
        status = "latest" if r["latest"] else ""
        if r.get("note"):
            status += f" ({r['note']})"
        if r["status"] == "incomplete":
            status = "incomplete (leftover temporary of an interrupted write)"
        elif r["status"] != "committed":
            status = (status + " " if status else "") + r["status"].upper()
            if r["status"] == "missing part":
                status += f" ({r['error']})"
        table.append(["*" if r["latest"] else " ", r["name"],
                      "-" if r["step"] is None else str(r["step"]),
                      "-" if r["world_size"] is None else str(r["world_size"]),
                      _human(r["bytes"]), _date(r["_mtime"]), status])
    if table:
        for line in _table(table, [" ", "NAME", "STEP", "RANKS", "SIZE", "DATE", "STATUS"],
                           right={2, 3, 4}):
            print(line)
    n_tmp = sum(r["status"] == "incomplete" for r in rows)
    if n_tmp:
        print(f"{n_tmp} incomplete leftover(s); `gockpt clean {root}` removes those of "
              "processes that are no longer running")
    return 0


def cmd_clean(args) -> int:
    if not os.path.isdir(args.dir):
        raise UsageError(f"{args.dir}: no such directory")
    removed = storage.cleanup_temporaries(args.dir)
    for p in removed:
        print(f"removed {p}")
    left = [n for n in os.listdir(args.dir) if n.startswith(storage.TMP_PREFIX)]
    print(f"{len(removed)} leftover(s) removed" +
          (f"; {len(left)} kept (their writer is still running)" if left else ""))
    return 0


# ---------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify, export and list gockpt checkpoints.",
        epilog="PATH is a checkpoint directory or a run directory (then its latest checkpoint). "
               "Exit status: 0 ok, 1 bad checkpoint, 2 usage error or nothing found.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("inspect", help="step, mode, tensors, sizes, ranks, timings")
    s.add_argument("path", metavar="PATH")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--brief", action="store_true", help="omit the per-tensor table")
    s.add_argument("--rank", type=int, metavar="R",
                   help="checkpoint written by several ranks: show rank R's part in full "
                        "(tensor table, timings, model)")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad tensor")
    s.add_argument("path", metavar="PATH")
    s.add_argument("--all", action="store_true",
                   help="PATH is a run directory: verify every committed checkpoint in it")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("export", help="write consolidated weights other tools load without gockpt")
    s.add_argument("path", metavar="PATH")
    s.add_argument("--to", required=True, choices=("safetensors", "torch"),
                   help="safetensors: the model's state_dict (tied parameters as copies); "
                        "torch: torch.save({'model', 'optimizer', 'step'[, 'scheduler']})")
    s.add_argument("out", metavar="OUT")
    s.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    s.add_argument("--rank", type=int, metavar="R",
                   help="checkpoint written by several ranks: export rank R's part (default 0)")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("list", help="checkpoints of a run directory, latest and leftovers")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("clean", help="remove .tmp-* leftovers of writers that died")
    s.add_argument("dir", metavar="DIR")
    s.set_defaults(func=cmd_clean)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed usage and the error (status 2) or --help (0)
        return int(exc.code or 0)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BadCheckpoint as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except CheckpointNotFoundError as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except CorruptCheckpointError as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `gockpt inspect ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (GockptError, OSError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, OSError) else 1


if __name__ == "__main__":
    sys.exit(main())
