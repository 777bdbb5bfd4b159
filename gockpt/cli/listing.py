"""``gockpt list`` (the checkpoints of a run directory, which is latest, leftovers of
interrupted writes) and ``gockpt clean`` (remove the leftovers of writers that died, and the
memory tier's copies of a run that ended)."""

from __future__ import annotations

import os
import warnings

from .. import storage
from ..core.errors import (CheckpointNotFoundError, CorruptCheckpointError, DirectoryInUseError,
                           GockptError)
from ..core.paths import is_remote, shown
from ..storage import memory_tier
from ..storage.commit import is_committed
from ..storage.lock import DirectoryLock
from ..storage.manifest import parse as parse_manifest, parts_of
from .common import (UsageError, date, disk_usage, existing_directory, human, iso, mtime, one_line,
                     print_json, table)


def cmd_list(args) -> int:
    """``gockpt list DIR [--json]``."""
    root = existing_directory(args.dir)
    rows = list_rows(root)
    if args.json:
        print_json([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])
    else:
        print_listing(root, rows)
    return 0


def cmd_clean(args) -> int:
    """``gockpt clean DIR [--memory [--memory-dir D]]``: remove the ``.tmp-*`` leftovers of
    processes no longer running; with ``--memory``, also the memory tier's copies of DIR's
    checkpoints, unless a Checkpointer of DIR still runs (they are its restart's)."""
    root = existing_directory(args.dir)
    removed = storage.cleanup_temporaries(root)
    for p in removed:
        print(f"removed {p}")
    left = [n for n in os.listdir(root) if n.startswith(storage.TMP_PREFIX)]
    print(f"{len(removed)} leftover(s) removed" +
          (f"; {len(left)} kept (their writer is still running)" if left else ""))
    if args.memory:
        try:
            lock = DirectoryLock(root)
        except DirectoryInUseError:
            print("the memory copies stay: a Checkpointer of this directory is running")
            return 0
        try:
            where = memory_tier.root_of(root, args.memory_dir)
            print(f"removed the memory copies {where}" if memory_tier.remove(root, args.memory_dir)
                  else f"no memory copies of this directory in {os.path.dirname(where)}")
        finally:
            lock.release()
    return 0


def list_rows(root: str) -> list:
    """One dict per committed checkpoint of ``root`` (oldest first), then one per leftover
    temporary: name, path, step, world_size, bytes, date, latest, status (``committed``,
    ``corrupt manifest``, ``missing part``, ``incomplete``) and, where it applies, error and
    note. ``_mtime`` (for printing) is not part of the JSON output."""
    names = storage.list_checkpoints(root)
    latest, latest_note = _latest(root) if names else (None, None)
    rows = []
    for name in names:
        row = _row(root, name, "committed")
        row["latest"] = name == latest
        _read_row(row, os.path.join(root, name))
        if row["latest"] and latest_note:
            row["note"] = latest_note
        rows.append(row)
    if is_remote(root):  # a store has no temporaries: an object appears whole or not at all
        return rows
    try:
        entries = sorted(os.listdir(root))
    except OSError as exc:
        raise UsageError(f"{root}: cannot list: {exc.strerror or exc}") from None
    rows += [_row(root, name, "incomplete") for name in entries
             if name.startswith(storage.TMP_PREFIX)]
    return rows


def print_listing(root: str, rows: list) -> None:
    """Print the rows of :func:`list_rows` as a table, with hints."""
    if not any(r["status"] != "incomplete" for r in rows):
        hint = ""
        try:
            storage.read_manifest(root)
            hint = f" ({root} is itself a checkpoint: try `gockpt inspect {root}`)"
        except GockptError:
            pass
        print(f"no committed checkpoints in {root}{hint}")
    lines = []
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
        lines.append(["*" if r["latest"] else " ", r["name"],
                      "-" if r["step"] is None else str(r["step"]),
                      "-" if r["world_size"] is None else str(r["world_size"]),
                      human(r["bytes"]), date(r["_mtime"]), status])
    if lines:
        for line in table(lines, [" ", "NAME", "STEP", "RANKS", "SIZE", "DATE", "STATUS"],
                          right={2, 3, 4}):
            print(line)
    n_tmp = sum(r["status"] == "incomplete" for r in rows)
    if n_tmp:
        print(f"{n_tmp} incomplete leftover(s); `gockpt clean {root}` removes those of "
              "processes that are no longer running")


def _latest(root: str) -> tuple:
    """(name of the latest checkpoint or None, a note if ``latest`` is missing or stale)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            latest = os.path.basename(storage.resolve(root))
        except CheckpointNotFoundError:
            latest = None
    return latest, "newest; the latest pointer is missing or stale" if w else None


def _row(root: str, name: str, status: str) -> dict:
    path = os.path.join(root, name)
    t = mtime(path)
    return {"name": name, "path": shown(path), "step": None, "world_size": None,
            "bytes": disk_usage(path), "date": iso(t), "_mtime": t, "latest": False,
            "status": status}


def _read_row(row: dict, path: str) -> None:
    """Fill in the step and ranks of the checkpoint ``path`` from its manifest, flagging a
    corrupt manifest or a missing part (cheap: a part's manifest is its commit mark; `verify`
    reads the parts)."""
    try:
        data = storage.read_manifest(path)
        row["step"] = parse_manifest("", tolerant=True, data=data).step
        row["world_size"] = 1
        names = parts_of(path, data)
        if names is not None:
            row["world_size"] = len(names)
            gone = [n for n in names if not is_committed(os.path.join(path, n))]
            if gone:
                row["status"] = "missing part"
                row["error"] = f"part(s) missing: {', '.join(gone)}"
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        row["status"] = "corrupt manifest"
        row["error"] = one_line(exc)
