"""What the ``gockpt`` commands share: the checkpoint a path names, the parts of a checkpoint
written by several ranks, and how sizes, times and tables are written (the errors that become
exit statuses: ``status.py``)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from typing import List, Optional

from .. import storage
from ..core.errors import CheckpointNotFoundError, CorruptCheckpointError, GockptError
from ..core.paths import is_remote, real_directory
from ..storage import remote
from ..storage.commit import bytes_under, checkpoint_of
from ..storage.format import MANIFEST_FILE
from ..storage.verify import Part, read_parts
from .status import PROG, BadCheckpoint, UsageError, one_line

# ---------------------------------------------------------------------------------- paths


def real_path(path: str) -> str:
    """``path`` resolved as the library resolves a directory (:mod:`gockpt.core.paths`: by the
    kernel's rule, absolute, links followed; it need not exist); UsageError saying why it
    names nothing (a ``..`` after a name that does not exist, a file in the way)."""
    try:
        return real_directory(path)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None


def existing_directory(path: str) -> str:
    """:func:`real_path` of a directory that must exist; UsageError otherwise. An ``s3://``
    URL is taken as written (a prefix in a store always "exists")."""
    if is_remote(path):
        return path.rstrip("/")
    real = real_path(path)
    if not os.path.exists(real):
        raise UsageError(f"{path}: no such file or directory")
    if not os.path.isdir(real):
        raise UsageError(f"{path}: not a directory")
    return real


def resolve_checkpoint(path: str) -> tuple:
    """(checkpoint directory, run directory or None, warnings) for a checkpoint directory or a
    run directory (then its latest checkpoint); UsageError if it is neither. Both resolved as
    ``gockpt.load`` resolves its directory (:func:`real_path`); an ``s3://`` URL as written."""
    if is_remote(path):
        real = path.rstrip("/")
    else:
        real = real_path(path)
        if not os.path.exists(real):
            raise UsageError(f"{path}: no such file or directory")
        if not os.path.isdir(real):
            raise UsageError(f"{path}: not a directory (give a checkpoint directory or a run "
                             "directory holding checkpoints)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = checkpoint_of(real)  # the checkpoint itself, or the run's latest
        except CheckpointNotFoundError as exc:
            raise UsageError(f"{path}: neither a gockpt checkpoint nor a run directory holding "
                             f"one ({one_line(exc)})") from None
    return found, None if found == real else real, [one_line(w.message) for w in caught]


def read_manifest(path: str) -> dict:
    """The validated manifest of ``path``: UsageError if absent, BadCheckpoint if corrupt."""
    try:
        return storage.read_manifest(path)
    except CheckpointNotFoundError as exc:
        raise UsageError(one_line(exc)) from None
    except CorruptCheckpointError as exc:
        raise BadCheckpoint(one_line(exc)) from None


def select_part(path: str, parts: List[Part], rank: int) -> Part:
    """The readable part of ``rank``: UsageError if out of range, BadCheckpoint if unreadable."""
    if not 0 <= rank < len(parts):
        raise UsageError(f"{path} has parts for ranks 0..{len(parts) - 1}; --rank {rank} asked")
    part = parts[rank]
    if part.data is None:
        raise BadCheckpoint(f"{path}: part {part.name} (rank {rank}) is missing or "
                            f"unreadable: {part.error}")
    return part


def every_part(path: str, data: dict, what: str) -> list:
    """(path, manifest data) of every rank's part of the checkpoint at ``path`` (itself for a
    checkpoint written by one process); BadCheckpoint naming each part missing or wrong."""
    parts = read_parts(path, data)
    if parts is None:
        return [(path, data)]
    bad = [f"{q.name}: {q.error or '; '.join(q.problems)}" for q in parts
           if q.data is None or q.problems]
    if bad:
        raise BadCheckpoint(f"{path}: {what} needs every rank's part: {'; '.join(bad)}")
    return [(q.path, q.data) for q in parts]


def no_rank_for_single(path: str, rank: Optional[int]) -> None:
    """UsageError for ``--rank`` other than 0 on a checkpoint written by one process."""
    if rank not in (None, 0):
        raise UsageError(f"{path} was written by a single process (rank 0 only); "
                         f"--rank {rank} asked")


# ---------------------------------------------------------------------------------- output


def warn(msgs) -> None:
    """Each of ``msgs`` as a one-line warning on stderr."""
    for m in msgs:
        print(f"{PROG}: warning: {m}", file=sys.stderr)


def print_json(obj) -> None:
    """``obj`` as indented JSON on stdout."""
    print(json.dumps(obj, indent=2, default=str))


def human(n: Optional[int]) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ... (``-`` for None)."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def seconds(x) -> str:
    """A duration in seconds, ``-`` if not a number."""
    return f"{x:.4f}s" if isinstance(x, (int, float)) else "-"


def date(ts: Optional[float]) -> str:
    """A timestamp as local date and time (``-`` for None)."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def iso(ts: Optional[float]) -> Optional[str]:
    """A timestamp in ISO 8601 with the local offset (None for None)."""
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def table(rows, header, right=()) -> list:
    """Rows of strings as aligned text columns; column indices in ``right`` align right."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    out = []
    for r in [header] + rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


# ---------------------------------------------------------------------------------- files


def disk_usage(path: str) -> Optional[int]:
    """Bytes of the regular files under ``path`` (or of ``path`` itself if it is a file); of
    the objects under an ``s3://`` prefix."""
    if is_remote(path):
        try:
            bucket, key = remote.bucket_of(path)
            return sum(o["size"] for o in bucket.list_all(key))
        except GockptError:
            return None
    try:
        return bytes_under(path)
    except OSError:
        return None


def mtime(path: str) -> Optional[float]:
    """Modification time of ``path`` (None if it cannot be read). A checkpoint directory's is
    that of the last entry created in it before the atomic rename: its commit time."""
    if is_remote(path):  # the upload of its manifest: its commit in the store
        try:
            bucket, key = remote.bucket_of(os.path.join(path, MANIFEST_FILE))
            meta = bucket.head(key)
        except GockptError:
            return None
        return meta["last_modified"].timestamp() if meta and meta["last_modified"] else None
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None
