"""Making a checkpoint visible, finding it again, and cleaning up.

Crash safety: everything is written into ``<root>/.tmp-<name>-<pid>-<random>``, fsynced, and only
then renamed to ``<root>/<name>``; ``latest`` is replaced with ``os.replace``. A crash at any
point leaves either the previous state or the new one, plus perhaps a ``.tmp-*`` entry that
:func:`cleanup_temporaries` removes.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import warnings
from typing import Callable, Optional

from ..core.errors import CheckpointNotFoundError, ConfigError, GockptError, StorageError
from ..core.paths import is_remote
from .format import (LATEST_FILE, LATEST_MAX_BYTES, MANIFEST_FILE, MANIFEST_MAX_BYTES, TMP_PREFIX,
                     TMP_RE, check_name, fsync_dir, manifest_seal, write_all)
from . import remote
from .manifest_file import read_manifest, read_small_file

log = logging.getLogger("gockpt")


def write_file(path: str, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(root: str, tmp_path: str, name: str) -> None:
    """Rename the temporary directory ``tmp_path`` to ``<root>/<name>``, replacing an old
    checkpoint of that name only once the new one is in place."""
    final = os.path.join(root, name)
    old = None
    if os.path.lexists(final):
        # No atomic directory swap in the stdlib: move the old one aside
        # (still a .tmp-* name, so cleanup_temporaries finds it after a crash).
        old = os.path.join(root, f"{TMP_PREFIX}{name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(final, old)
    try:
        os.rename(tmp_path, final)
    except OSError:
        if old is not None:
            os.rename(old, final)  # put the previous checkpoint back
        raise
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def replace_file(path: str, write: Callable[[str], None]) -> None:
    """Atomically create or replace the file ``path`` with what ``write(tmp)`` writes to the
    temporary file ``tmp`` beside it (a ``.tmp-*`` name: :func:`cleanup_temporaries` removes
    it after a crash). ``tmp`` is fsynced and renamed to ``path``, then the directory fsynced;
    on an error ``tmp`` is removed and ``path`` left as it was."""
    root, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(root, f"{TMP_PREFIX}{base}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(root)


def write_latest(root: str, name: str, seal: Optional[str] = None) -> None:
    """Atomically make ``<root>/latest`` name checkpoint ``name``; with ``seal`` (its
    manifest's, :func:`~.format.manifest_seal`) on a second line, so that a damaged pointer --
    or one naming another checkpoint -- is told from a good one (without: a plain pointer, as
    DeepSpeed writes its own)."""
    text = name if seal is None else f"{name}\n{seal}\n"
    replace_file(os.path.join(root, LATEST_FILE), lambda tmp: write_file(tmp, text.encode("utf-8")))


def read_latest(root: str) -> tuple:
    """What ``<root>/latest`` says: ``(name, seal)``; ``(None, None)`` when there is no pointer.
    ``seal`` is None for a plain pointer (one line). Raises ``ValueError`` saying what is
    wrong with a pointer that is not one (not a regular file, too long, not text, a name that
    is not a checkpoint name, a malformed seal)."""
    path = os.path.join(root, LATEST_FILE)
    try:
        data = read_small_file(path, LATEST_MAX_BYTES, f"{path!r}")
    except FileNotFoundError:
        return None, None
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from e
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not text") from None
    if len(lines) not in (1, 2) or (len(lines) == 2 and not _is_seal(lines[1])):
        raise ValueError(f"{path!r} is not a pointer (one checkpoint name, and its manifest's "
                         "seal)")
    name = lines[0].strip()
    check_name(name, f"checkpoint name in {path!r}")
    return name, lines[1] if len(lines) == 2 else None


def _is_seal(x: str) -> bool:
    return len(x) == 8 and all(c in "0123456789abcdef" for c in x)


def check_step_name(root: str, name: str) -> None:
    """Raise ConfigError unless a save may write checkpoint ``name`` of ``root``: no entry has
    that name, or it is a committed checkpoint of a later step than the one ``latest`` names
    -- left by a job killed between that checkpoint's commit and ``latest``'s update, which
    the resumed job went back past. That one is replaced once the new one is complete (as
    the Checkpointer's step-named checkpoints are). Refused, each saying why: ``latest``'s
    own checkpoint and any of its step or before (a second save of a name, or another job's
    checkpoints), an entry that is not a committed checkpoint (a link, a directory without a
    manifest), any entry while ``latest`` is missing or unreadable."""
    try:
        check_name(name, "checkpoint name")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    path = os.path.join(root, name)
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not is_committed(path):
        raise ConfigError(f"{path!r} exists and is not a committed checkpoint (a link, or a "
                          "directory without a manifest); pick another name or remove it")
    current, why = None, "is missing"
    try:
        current = read_latest(root)[0]
        if current is not None:
            step = read_manifest(path)["step"]
            latest_step = read_manifest(os.path.join(root, current))["step"]
    except (ValueError, OSError, GockptError) as e:
        current, why = None, f"or what it names cannot be read ({e})"
    if current is None:
        raise ConfigError(f"a checkpoint named {name!r} exists in {root!r} already and "
                          f"{os.path.join(root, LATEST_FILE)!r} {why}; pick another name")
    if current == name or step <= latest_step:
        raise ConfigError(f"a checkpoint named {name!r} (step {step}) exists in {root!r} "
                          f"already, and {LATEST_FILE!r} names {current!r} (step {latest_step})"
                          "; pick another name (only a checkpoint of a later step than "
                          f"{LATEST_FILE!r}'s, left by a job killed before it updated "
                          f"{LATEST_FILE!r}, is replaced)")


def is_committed(path: str) -> bool:
    """Whether ``path`` is a committed checkpoint: manifest.json is written inside the temporary
    directory before the rename, so a visible directory with a manifest is one (whatever the
    manifest has become since: reading it says what is wrong with it)."""
    if is_remote(path):
        try:
            remote.size_of(os.path.join(path, MANIFEST_FILE))
            return True
        except FileNotFoundError:
            return False
    return os.path.lexists(os.path.join(path, MANIFEST_FILE))


def list_checkpoints(root: str) -> list[str]:
    """Names of the committed checkpoints in ``root``, oldest first.

    Age is the modification time of ``manifest.json`` (written at commit), ties
    broken by name. Temporaries (``.tmp-*``) and other entries are ignored; a
    missing root gives an empty list.
    """
    if is_remote(root):
        return _list_remote(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(f"cannot list checkpoint directory {root!r}: {e}") from e
    found = []
    for name in names:
        if name.startswith(".") or name == LATEST_FILE:
            continue
        manifest = os.path.join(root, name, MANIFEST_FILE)
        try:
            found.append((os.stat(manifest).st_mtime_ns, name))
        except OSError:
            continue  # not a checkpoint directory
    return [name for _, name in sorted(found)]


def _list_remote(root: str) -> list[str]:
    """:func:`list_checkpoints` in an object store: each ``<name>/manifest.json`` right under
    ``root`` (uploaded last: its object is the commit), oldest upload first."""
    bucket, prefix = remote.bucket_of(root)
    found = []
    for meta in bucket.list_all(prefix):
        rel = meta["path"][len(prefix) + 1:] if prefix else meta["path"]
        name, _, rest = rel.partition("/")
        if rest == MANIFEST_FILE and not name.startswith(".") and name != LATEST_FILE:
            found.append((meta["last_modified"], name))
    return [name for _, name in sorted(found)]


def _describe_root(root: str) -> str:
    names = list_checkpoints(root)
    if not names:
        return f"{root!r} contains no committed checkpoint"
    shown = ", ".join(names[-10:])
    more = f" (and {len(names) - 10} older)" if len(names) > 10 else ""
    return f"{root!r} contains: {shown}{more}"


def checkpoint_of(path: str, tag: str | None = None) -> str:
    """The checkpoint ``path`` names: ``path`` itself when it is a committed checkpoint
    (``run1/step-000000010``) and no ``tag`` is given, else :func:`resolve` of the run
    directory ``path`` -- what ``gockpt.load`` and the tools take."""
    if tag is None and is_committed(path) and not os.path.lexists(
            os.path.join(path, LATEST_FILE)):
        return path.rstrip("/")
    return resolve(path, tag)


def resolve(root: str, tag: str | None = None) -> str:
    """Path of checkpoint ``tag`` in ``root``, or (tag None or "latest") of the one ``<root>/latest`` names.

    If ``latest`` is missing or names a checkpoint that does not exist, falls
    back to the newest committed checkpoint with a warning. Raises
    ``CheckpointNotFoundError`` saying what ``root`` contains if nothing fits.
    """
    if not is_remote(root) and not os.path.isdir(root):
        if os.path.exists(root):
            raise CheckpointNotFoundError(
                f"{root!r} is a file, not a directory: give the run directory (the one holding "
                f"{LATEST_FILE!r} and the checkpoints) or one checkpoint's directory")
        raise CheckpointNotFoundError(f"checkpoint directory {root!r} does not exist")
    if tag == LATEST_FILE:
        tag = None
    if tag is not None:
        try:
            check_name(tag, "checkpoint tag")
        except ValueError as e:
            raise CheckpointNotFoundError(str(e)) from None
        path = os.path.join(root, tag)
        if not is_committed(path):
            raise CheckpointNotFoundError(f"no checkpoint {tag!r}: {_describe_root(root)}")
        return path

    latest_path = os.path.join(root, LATEST_FILE)
    try:
        latest, seal = read_latest(root)
    except ValueError as e:
        latest, why = "", f"is damaged ({e})"
    else:
        why = "is missing" if latest is None else \
            f"names {latest!r}, which is not a committed checkpoint"
    if latest:
        path = os.path.join(root, latest)
        if is_committed(path):
            actual = _manifest_seal_of(path)
            # (None: the manifest itself is damaged, not the pointer -- reading it names how)
            if seal is None or actual is None or actual == seal:
                return path
            why = (f"names {latest!r} but does not match its manifest (the pointer is "
                   "damaged, or the checkpoint was replaced)")
    names = list_checkpoints(root)
    if not names:
        raise CheckpointNotFoundError(f"no checkpoint to load: {_describe_root(root)}; "
                                      f"{latest_path!r} {why}")
    same = " (the one it names)" if names[-1] == latest else ""
    warnings.warn(
        f"{latest_path!r} {why}; using the newest committed checkpoint {names[-1]!r}{same}",
        RuntimeWarning,
        stacklevel=2,
    )
    return os.path.join(root, names[-1])


def _manifest_seal_of(path: str) -> Optional[str]:
    """The seal of the manifest of checkpoint ``path`` (None: unreadable, or damaged)."""
    try:
        return manifest_seal(read_small_file(os.path.join(path, MANIFEST_FILE),
                                             MANIFEST_MAX_BYTES, MANIFEST_FILE))
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OverflowError:
        return False
    return True


def cleanup_temporaries(root: str) -> list[str]:
    """Remove ``.tmp-*`` entries of ``root`` left behind by processes that are no longer alive.

    Entries of live processes (including this one) are kept. Returns the paths
    removed. Note: liveness is checked on this host only, so on a file system
    shared between machines call it only when no other machine is writing.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        m = TMP_RE.match(name)
        if not m or _pid_alive(int(m.group(2))):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def apply_retention(directory: str, keep: Optional[int]) -> None:
    """Delete committed checkpoints beyond ``keep`` (after a newer one committed)."""
    if keep is None:
        return
    names = list_checkpoints(directory)
    latest = os.path.basename(resolve(directory))
    for name in [n for n in names if n != latest][:max(0, len(names) - keep)]:
        try:
            discard(directory, name)
        except OSError as exc:
            log.warning("gockpt: could not delete old checkpoint %s: %s", name, exc)


def discard(root: str, name: str) -> None:
    """Delete ``<root>/<name>`` as a reader sees it: renamed to a ``.tmp-*`` name first (gone
    at once, whole; a crash mid-delete leaves what :func:`cleanup_temporaries` removes), then
    removed. OSError when the rename fails."""
    doomed = os.path.join(root, f"{TMP_PREFIX}{name}.old-{os.getpid()}-{os.urandom(4).hex()}")
    os.rename(os.path.join(root, name), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def bytes_under(path: str) -> int:
    """Bytes of the regular files under directory ``path`` (of ``path`` itself if it is a
    file or a link), links not followed; a file gone meanwhile counts nothing. OSError when
    ``path`` itself cannot be read."""
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for base, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(base, f)).st_size
            except OSError:
                pass
    return total


def ensure_writable(directory: str) -> None:
    """Fail at construction, not at the first checkpoint, when the directory is unusable."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".gockpt-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise StorageError(
            f"checkpoint directory {directory!r} is not a writable directory ({exc.strerror or exc}); "
            "pass a path you can write to") from exc
