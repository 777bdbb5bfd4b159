"""``gockpt export``: consolidated weights that other tools load without gockpt (safetensors:
the model's ``state_dict``; torch: ``torch.save`` of model, optimizer, step and scheduler;
fp32: DeepSpeed's fp32 master weights; deepspeed: DeepSpeed's own checkpoint directory -- both
built by :mod:`gockpt.integrations.deepspeed`, which knows DeepSpeed's layout)."""

from __future__ import annotations

import json
import os

import torch

try:  # an optional package: --to safetensors and --to fp32 say so when it is missing
    from safetensors.torch import save_file
except ImportError:
    save_file = None

from .. import storage
from ..core.paths import shown
from ..loading import check_digests
from ..storage import dcp, shares
from ..storage.commit import replace_file
from ..storage.manifest import parse as parse_manifest, read as read_part
from ..storage.schema import Manifest
from ..storage.verify import read_parts
from ..integrations.deepspeed import export as ds_export
from ..integrations.deepspeed.export_files import read_parts as read_engine_parts
from ..integrations.deepspeed.export_fp32 import consolidated_fp32
from ..storage.statedict import model_state, optimizer_state
from .common import (BadCheckpoint, UsageError, every_part, human, no_rank_for_single,
                     read_manifest, real_path, resolve_checkpoint, select_part, warn)


def cmd_export(args) -> int:
    """``gockpt export PATH --to {safetensors,torch,fp32} OUT [--rank R] [--force]``, or
    ``--to deepspeed OUT_DIR [--ds-config CONFIG]`` (a directory)."""
    if args.to == "deepspeed":
        return _export_deepspeed(args)
    if getattr(args, "ds_config", None) is not None:
        raise UsageError("--ds-config is for --to deepspeed")
    if os.path.isdir(args.out):
        raise UsageError(f"{args.out}: is a directory; give the output file name")
    if os.path.exists(args.out) and not args.force:
        raise UsageError(f"{args.out}: exists; pass --force to overwrite it")
    if args.to in ("safetensors", "fp32") and save_file is None:
        raise UsageError(f"--to {args.to} needs the safetensors package (pip install "
                         "safetensors)")
    if args.to == "fp32":
        return _export_fp32(args)
    shard_size = getattr(args, "shard_size", None)
    if shard_size is not None and (args.to != "safetensors" or shard_size <= 0):
        raise UsageError("--shard-size is a positive number of bytes, for --to safetensors")
    path, data, part = _source(args)
    m = parse_manifest(path, data)
    if m.model.slices:  # one rank's shards are no model: every rank's, put together
        if args.to != "safetensors":
            raise UsageError(f"{path}: its parameters are slices of global tensors (FSDP2, "
                             "tensor parallel); --to safetensors writes them put together")
        if args.rank is not None:
            raise UsageError(f"{path}: its parameters are slices of global tensors; --to "
                             "safetensors writes every rank's put together, --rank does not apply")
        return _export_whole(args.out, os.path.dirname(path), shard_size)
    # replicas that wrote one state in shares: every part's, put together (this part's small
    # state); a part of per-rank state is that rank's
    shared = shares.gather(os.path.dirname(path), m, verify=True, check=check_digests) \
        if part else None
    if shared is not None:
        m, tensors = shared
        part = None
    else:
        tensors = storage.read_tensors(path, m, verify=True)
    sd, aliases = model_state(path, m, tensors)
    source = f" (rank {part[0]} of {part[1]}, part {part[2]})" if part else \
        (" (every rank's share, put together)" if shared is not None else "")
    if args.to == "safetensors":
        meta = {"format": "pt", "gockpt_step": str(m.step), "gockpt_mode": str(m.mode),
                "gockpt_source": shown(path)}
        if part:
            meta.update(gockpt_rank=str(part[0]), gockpt_world_size=str(part[1]))
        written, what, notes = _save_safetensors(args.out, sd, aliases, meta, shard_size)
    else:
        obj = {"model": sd, "step": m.step}
        if part:
            obj["rank"], obj["world_size"] = part[0], part[1]
        written, what, notes = _save_torch(args.out, obj, path, m, tensors)
    nbytes = sum(t.numel() * t.element_size() for t in written.values())
    print(f"wrote {args.out}: {what} of step {m.step} from {shown(path)}{source} "
          f"({len(written)} model tensors, {human(nbytes)})")
    for n in notes:
        print(f"note: {n}")
    return 0


def _export_whole(out: str, top: str, shard_size) -> int:
    """A checkpoint whose parameters are slices of global tensors (FSDP2's shards, HSDP's
    shares of them), every tensor put together through the DCP reader: each stored slice read
    once, every chunk's checksum checked."""
    _, m = read_part(top, 0)
    reader = dcp.GockptReader(top)
    md = reader.read_metadata().state_dict_metadata
    aliases = dict(m.model.aliases)
    sd = {k[len("model."):]: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
          if k.startswith("model.") and hasattr(v, "size") and k[len("model."):] not in aliases}
    dcp.load({"model": sd}, reader, alone=True)
    sd.update({alias: sd[canon] for alias, canon in aliases.items() if canon in sd})
    meta = {"format": "pt", "gockpt_step": str(m.step), "gockpt_mode": str(m.mode),
            "gockpt_source": shown(top)}
    written, what, notes = _save_safetensors(out, sd, aliases, meta, shard_size)
    nbytes = sum(t.numel() * t.element_size() for t in written.values())
    print(f"wrote {out}: {what} of step {m.step} from {shown(top)} (every rank's "
          f"slices, put together: {reader.read_bytes} bytes read) ({len(written)} model "
          f"tensors, {human(nbytes)})")
    for n in notes:
        print(f"note: {n}")
    return 0


def _export_fp32(args) -> int:
    """Every rank's fp32 fragments, put together (gockpt.integrations.deepspeed checkpoints)."""
    path, _run, warns = resolve_checkpoint(args.path)
    warn(warns)
    sources = every_part(path, read_manifest(path), "--to fp32")
    parts = read_engine_parts(sources)
    sd = consolidated_fp32(parts)
    step = parts[0].m.step
    meta = {"format": "pt", "gockpt_step": str(step), "gockpt_source": shown(path),
            "gockpt_dtype": "fp32 master weights"}
    written, _, _ = _save_safetensors(args.out, sd, {}, meta)
    nbytes = sum(t.numel() * t.element_size() for t in written.values())
    print(f"wrote {args.out}: fp32 master weights of step {step} from {shown(path)} "
          f"({len(sources)} part(s), {len(written)} parameters, {human(nbytes)})")
    return 0


def _export_deepspeed(args) -> int:
    """Every rank's part in DeepSpeed's own layout (gockpt.integrations.deepspeed checkpoints)."""

    if args.rank is not None:
        raise UsageError("--to deepspeed writes every rank's part; --rank does not apply")
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{out}: not a directory; --to deepspeed writes a checkpoint directory")
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        raise UsageError(f"{out}: exists and is not empty; pass --force to write into it")
    _parent_of(out)
    path, _run, warns = resolve_checkpoint(args.path)
    warn(warns)
    where, source = os.path.realpath(out), os.path.realpath(path)
    if where in (source, os.path.dirname(source)) or where.startswith(source + os.sep):
        raise UsageError(f"{out}: is the gockpt checkpoint or its run directory; its 'latest' "
                         "would name the export. Give another directory")
    export = ds_export.build(every_part(path, read_manifest(path), "--to deepspeed"),
                                    args.ds_config)
    ds_export.write(out, export, args.force)
    print(f"wrote {out}: {ds_export.describe(export)} from {shown(path)}; "
          f"'latest' names it: engine.load_checkpoint({out!r})")
    for n in export.notes:
        print(f"note: {n}")
    return 0


def _source(args) -> tuple:
    """(directory to export, its manifest, None or (rank, world size, part name) for a part of
    a checkpoint written by several ranks)."""
    path, _run, warns = resolve_checkpoint(args.path)
    warn(warns)
    data = read_manifest(path)
    parts = read_parts(path, data)
    if parts is None:
        no_rank_for_single(path, args.rank)
        return path, data, None
    rank = 0 if args.rank is None else args.rank
    part = select_part(path, parts, rank)
    if part.problems:
        raise BadCheckpoint(f"{path}: {'; '.join(part.problems)}")
    warn([f"{path}: part {q.name} (rank {q.rank}) is missing or unreadable; "
          f"exporting rank {rank}'s part anyway" for q in parts if q.data is None])
    return part.path, part.data, (rank, len(parts), part.name)


def _save_safetensors(out: str, sd: dict, aliases: dict, meta: dict,
                      shard_size: int | None = None) -> tuple:
    """Write the model's tensors -- with ``shard_size``, in files of at most that many bytes
    (a tensor larger alone in its file) and Hugging Face's index beside them: ``OUT`` names
    ``<stem>.safetensors.index.json``, the files ``<stem>-0000i-of-0000n.safetensors``; returns
    (tensors written, what, notes)."""
    tensors, notes = {}, []
    for name, v in sd.items():
        if not isinstance(v, torch.Tensor):
            notes.append(f"skipped {name!r}: not a tensor ({type(v).__name__})")
            continue
        # safetensors refuses tensors that share memory: tied names get their own copy.
        tensors[name] = v.clone() if name in aliases else v.contiguous()
    for alias, canon in aliases.items():
        notes.append(f"tied parameter {alias!r} written as a separate copy of {canon!r}")
    if shard_size is None:
        _write(out, lambda tmp: save_file(tensors, tmp, metadata=meta))
        return tensors, "model state_dict", notes
    files: list = [{}]
    filled = 0  # bytes in the last file
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if files[-1] and filled + size > shard_size:
            files.append({})
            filled = 0
        files[-1][name] = t
        filled += size
    stem = os.path.basename(out)
    stem = stem[:-len(".safetensors")] if stem.endswith(".safetensors") else stem
    names = [f"{stem}-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    where = os.path.dirname(out)
    for name, shard in zip(names, files):
        _write(os.path.join(where, name), lambda tmp, shard=shard: save_file(shard, tmp,
                                                                             metadata=meta))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values()), **meta},
             "weight_map": {n: name for name, shard in zip(names, files) for n in shard}}
    _write(out, lambda tmp: _dump_json(index, tmp))
    return tensors, f"model state_dict in {len(files)} files and their index", notes


def _dump_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _save_torch(out: str, obj: dict, path: str, m: Manifest, tensors: dict) -> tuple:
    """torch.save ``obj`` plus the optimizer and scheduler; returns (model tensors, what, [])."""
    if m.optimizer is not None:
        obj["optimizer"] = optimizer_state(path, m, tensors)
    try:
        sched = m.small.decode("scheduler", tensors)
    except (KeyError, TypeError, ValueError):
        sched = None
    if sched is not None:
        obj["scheduler"] = sched
    _write(out, lambda tmp: torch.save(obj, tmp))
    what = "model state_dict" + (" + optimizer state_dict" if "optimizer" in obj else "") \
        + (" + scheduler" if "scheduler" in obj else "")
    return {n: v for n, v in obj["model"].items() if isinstance(v, torch.Tensor)}, what, []


def _parent_of(out: str) -> str:
    """The directory OUT goes into, resolved as every gockpt path is (the kernel's rule:
    ``x/../out`` needs an ``x``); UsageError if it does not exist."""
    d = real_path(os.path.dirname(out) or os.curdir)
    if not os.path.isdir(d):
        raise UsageError(f"{out}: directory {d} does not exist")
    return d


def _write(out: str, write) -> None:
    _parent_of(out)
    replace_file(out, write)
