"""What ``gockpt inspect`` shows, as plain data (dicts of JSON values) built from the manifests
alone: no tensor data is read. :mod:`.inspect` prints these, or writes them as JSON."""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from .. import storage
from ..core.paths import shown
from ..storage.manifest import parse as parse_manifest
from ..storage.schema import Manifest
from ..storage.shares import own_state
from ..storage.verify import Part, world_size_problems
from .common import disk_usage, human, iso, mtime, one_line, select_part

# Each small section and what its tensors are called in the tensor table.
_SMALL_LABELS = (("model", "buffer"), ("optimizer", "optimizer"), ("scheduler", "scheduler"),
                 ("rng", "rng"), ("extra_state", "extra_state"))


def identity(path: str, run_dir: Optional[str], m: Manifest) -> dict:
    """The fields every summary starts with (single- and multi-rank)."""
    return {
        "path": shown(path),
        "run_dir": shown(run_dir) if run_dir else None,
        # read_manifest accepts no other format or version
        "format": storage.FORMAT,
        "format_version": storage.FORMAT_VERSION,
        "step": m.step,
        "start_step": m.start_step,
        "mode": m.mode,
        "overlap_steps": m.overlap_steps,
        "written": iso(mtime(path)),
    }


def checkpoint_summary(path: str, m: Manifest, run_dir: Optional[str]) -> dict:
    """Summary of a single-rank checkpoint (or of one rank's part) with manifest ``m``."""
    entries = m.tensors
    files, groups = {}, {}
    for name, e in entries.items():
        files[e["file"]] = files.get(e["file"], 0) + e["nbytes"]
        g = groups.setdefault(name.split("/", 1)[0] if "/" in name else "(other)",
                              {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += e["nbytes"]
    problems = []
    ranks = {k: v for k, v in (("rank", m.rank), ("world_size", m.world_size)) if v is not None}
    return {
        **identity(path, run_dir, m),
        "ranks": ranks or {"world_size": 1},
        "disk_bytes": disk_usage(path),
        "tensor_bytes": sum(e["nbytes"] for e in entries.values()),
        "files": files,
        "checksums": sorted({f"crc32c per {human(e['block_bytes'])} block"
                             for e in entries.values()}),
        "groups": groups,
        "model": _model_info(m, problems),
        "optimizer": _optimizer_info(m, problems),
        "scheduler": _describe(m, "scheduler", sorted),
        "extra_state": _describe(m, "extra_state", lambda x: sorted(map(str, x))),
        "metrics": m.metrics,
        "problems": problems,
    }


def part_summary(path: str, parts: List[Part], rank: int) -> tuple:
    """(summary, manifest) of ``rank``'s part, marked with the checkpoint it belongs to."""
    part = select_part(path, parts, rank)
    m = parse_manifest("", tolerant=True, data=part.data)
    s = checkpoint_summary(part.path, m, None)
    s["part_of"] = {"checkpoint": shown(path), "rank": rank, "name": part.name,
                    "world_size": len(parts)}
    s["problems"] = part.problems + s["problems"]
    return s, m


def parts_summary(path: str, data: dict, run_dir: Optional[str], parts: List[Part]) -> dict:
    """Summary of a checkpoint written by several ranks (manifest ``data``): its parts, sizes
    summed over them, and what the model and optimizer look like (from the lowest readable
    rank, ``described_rank``)."""
    top = parse_manifest("", tolerant=True, data=data)
    rows, ref = [], None
    total = {"tensor_count": 0, "tensor_bytes": 0, "files": {}, "groups": {}}
    problems = world_size_problems(data, parts)
    for part in parts:
        row, ps = _part_row(part)
        rows.append(row)
        problems.extend(part.problems)
        if ps is None:
            problems.append(f"part {part.name} (rank {part.rank}) is missing or unreadable: "
                            f"{part.error}")
            continue
        ref = ref or (part.rank, ps)
        _add_part(total, part.name, ps, row["tensors"])
        problems.extend(f"{part.name}: {x}" for x in ps["problems"])
    ref_rank, rs = ref if ref is not None else (None, {})
    world = top.world_size if top.world_size is not None else len(parts)
    return {
        **identity(path, run_dir, top),
        "ranks": {"world_size": world, "ranks": [p.name for p in parts]},
        "disk_bytes": disk_usage(path),
        **{k: total[k] for k in ("tensor_count", "tensor_bytes", "files")},
        "checksums": rs.get("checksums", []),
        "groups": total["groups"],
        "described_rank": ref_rank,
        "layout": _layout(data, parts),
        **{k: rs.get(k) for k in ("model", "optimizer", "scheduler", "extra_state")},
        "metrics": None,
        "parts": rows,
        "problems": problems,
    }


def _layout(data: dict, parts: List[Part]) -> dict:
    """How the ranks' state was laid out across the parts: replicated or per rank, in shares
    or not, how many parameters and optimizer state tensors are split across parts, and the
    parameters the global index lists in slices (DTensors: FSDP2, tensor parallelism)."""
    holders: dict = {}
    split = set()
    for part in parts:
        if part.data is None:
            continue
        m = parse_manifest("", tolerant=True, data=part.data)
        own = own_state(m)  # a slice of a global tensor: in "sharded" -- unless in shares
        for _, what, ref, key in m.stored_refs():
            if own(key) and ref.extent is None:
                continue
            holders.setdefault(what, set()).add(part.rank)
            if ref.extent is not None:
                split.add(what)
    index = data.get("index") if isinstance(data.get("index"), dict) else {}
    sharded = {name: {"shape": e.get("shape"), "slices": len(e["slices"])}
               for name, e in index.items() if isinstance(e, dict)
               and isinstance(e.get("slices"), list)}
    return {"world_size": len(parts), "replicated": data.get("replicated") is True,
            "shares": data.get("shares") is True, "tensors": len(holders),
            "split": {what: len(holders[what]) for what in sorted(split)},
            "sharded": sharded}


def tensor_table(m: Manifest) -> dict:
    """Every stored tensor: its manifest entry plus ``holds``, what it is to a person."""
    roles = _roles(m)
    return {name: dict(e, holds=roles.get(name, "")) for name, e in m.tensors.items()}


# ---------------------------------------------------------------------------------- parts


def _part_row(part: Part) -> tuple:
    """(row of the parts table, the part's summary or None if it is unreadable)."""
    row = {"rank": part.rank, "name": part.name, "path": part.path,
           "ok": part.data is not None and not part.problems, "error": part.error,
           "problems": list(part.problems), "step": None, "tensors": None,
           "tensor_bytes": None, "disk_bytes": disk_usage(part.path), "metrics": None}
    if part.data is None:
        return row, None
    m = parse_manifest("", tolerant=True, data=part.data)
    ps = checkpoint_summary(part.path, m, None)
    row.update(step=m.step, tensors=len(m.tensors), tensor_bytes=ps["tensor_bytes"],
               metrics=ps["metrics"])
    return row, ps


def _add_part(total: dict, name: str, ps: dict, n_tensors: int) -> None:
    """Add one part's summary ``ps`` to the checkpoint's ``total``."""
    total["tensor_count"] += n_tensors
    total["tensor_bytes"] += ps["tensor_bytes"]
    for f, n in ps["files"].items():
        total["files"][f"{name}/{f}"] = n
    for g, c in ps["groups"].items():
        acc = total["groups"].setdefault(g, {"tensors": 0, "bytes": 0})
        acc["tensors"] += c["tensors"]
        acc["bytes"] += c["bytes"]


# ---------------------------------------------------------------------------------- sections


def _model_info(m: Manifest, problems: list) -> dict:
    params = [r for r in m.model.params.values() if r.tensor in m.tensors]
    itemsize = {r: m.tensors[r.tensor]["nbytes"] // max(1, math.prod(m.tensors[r.tensor]["shape"]))
                for r in params}
    try:
        buffers = _decode_meta(m, "model")
        buffer_names = list(buffers) if isinstance(buffers, dict) else []
    except (ValueError, KeyError, TypeError) as exc:
        buffer_names = []
        problems.append(f"small/model: {one_line(exc)}")
    return {"params": len(m.model.params),
            "param_elements": sum(math.prod(_shape(m, r)) for r in params),
            "param_bytes": sum(math.prod(_shape(m, r)) * itemsize[r] for r in params),
            "buffers": buffer_names, "aliases": dict(m.model.aliases)}


def _optimizer_info(m: Manifest, problems: list) -> Optional[dict]:
    opt = m.optimizer
    if opt is None:
        return None
    info = {"class": opt.cls, "aligned_state": sorted({k for refs in opt.aligned.values()
                                                        for k in refs}),
            "aligned_params": len(opt.aligned)}
    try:
        osd = _decode_meta(m, "optimizer")
        info["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} | {"params": len(g["params"])}
            for g in osd["param_groups"]]
    except (ValueError, KeyError, TypeError) as exc:
        problems.append(f"small/optimizer: {one_line(exc)}")
    return info


def _describe(m: Manifest, section: str, keys):
    """None, ``keys(value)`` for a dict, else the type name of ``section``'s value (None if it
    does not decode)."""
    try:
        v = _decode_meta(m, section)
    except (ValueError, KeyError, TypeError):
        return None
    return None if v is None else keys(v) if isinstance(v, dict) else type(v).__name__


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


def _decode_meta(m: Manifest, section: str):
    """Decode small-state ``section`` without reading data; ValueError if malformed or absent."""
    return m.small.decode(section, _Placeholders(m.tensors))


def _roles(m: Manifest) -> dict:
    """Tensor name -> what it holds, for a person reading `inspect`."""
    roles, tied = {}, {}
    for alias, canon in m.model.aliases.items():
        tied.setdefault(canon, []).append(alias)
    for name, ref in m.model.params.items():
        extra = f" (tied: {', '.join(tied[name])})" if name in tied else ""
        _add_role(roles, ref, f"param {name}{extra}")
    for section, label in _SMALL_LABELS:
        for key, where in m.small.tensor_refs(section).items():
            roles[key] = f"{label} {where}".rstrip()
    # Optimizer index i is the i-th planned parameter (the plan lists the optimizer's
    # parameters first, in order); shown only where the shapes agree.
    names = list(m.model.params)
    for idx, refs in (m.optimizer.aligned if m.optimizer else {}).items():
        for key, ref in refs.items():
            role = f"optimizer state[{idx}][{key!r}]"
            try:
                pname = names[idx]
                if _shape(m, m.model.params[pname]) == _shape(m, ref):
                    role += f" of {pname}"
            except (IndexError, KeyError):
                pass
            _add_role(roles, ref, role)
    return roles


def _shape(m: Manifest, ref) -> tuple:
    """The logical shape ``ref`` refers to (KeyError if its tensor is not stored)."""
    return tuple(m.logical_shape(ref))


def _add_role(roles: dict, ref, role: str) -> None:
    """What stored tensor ``ref.tensor`` holds; a pack holds several, counted."""
    if ref.extent is not None and not ref.tensor.startswith("pack/"):
        lo, hi = ref.extent
        roles[ref.tensor] = f"{role}: elements {lo}..{hi} of {math.prod(ref.shape)} (a share)"
        return
    if ref.shape is None:
        roles[ref.tensor] = role
        return
    count = roles.get(ref.tensor, "pack of 0 small tensors")
    n = int(count.split()[2]) + 1 if count.startswith("pack of ") else 1
    roles[ref.tensor] = f"pack of {n} small tensors"
