"""The one rule by which a string names a directory, for every function and tool of gockpt:
the kernel's.

``./x/../ckpt/run`` once named two places: the Checkpointer normalised the text
(``os.path.abspath``: ``ckpt/run``, whether or not ``x`` exists) while ``gockpt.load`` asked
the kernel, for which ``x/..`` exists only through an existing ``x``. The kernel's rule is the
one every other program applies to the same string (``ls``, ``open``, ``torch.load``, a shell's
``cd -P``), and the only one that agrees with symbolic links (``link/..`` is the parent of the
link's target, not the directory holding the link). So: the longest part of the path that
exists is resolved by the kernel (symbolic links followed, ``..`` taken physically); what
follows must be plain names, which a Checkpointer may create; a ``..`` after a name that does
not exist is an error naming it, never a guess.

The result is absolute and free of links, fixed when the Checkpointer is built or the load
starts: a later ``chdir`` or a link changed under a running job does not move its checkpoints.
"""

from __future__ import annotations

import errno
import os

from .errors import CheckpointNotFoundError

__all__ = ["real_directory", "directory_to_read", "is_remote", "split_remote"]


def real_directory(path) -> str:
    """The absolute path, without symbolic links, of the directory that ``path`` names by the
    kernel's rule (see the module); it need not exist yet.

    Raises ``FileNotFoundError`` naming the component when a ``..`` follows a name that does
    not exist, ``NotADirectoryError`` when a component is a file, ``OSError`` for what the
    system refuses to look up (permissions, a loop of links), ``TypeError`` if ``path`` is
    not a path."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise FileNotFoundError(errno.ENOENT, "an empty path names no directory", text)
    # Absolute without normalising the text: the kernel reads the components as they are.
    parts = os.path.join(os.getcwd(), text).split(os.sep)
    for i in range(len(parts), 0, -1):
        head = os.sep.join(parts[:i]) or os.sep
        try:
            os.stat(head)
        except (FileNotFoundError, NotADirectoryError):
            continue
        break
    rest = [c for c in parts[i:] if c not in ("", ".")]
    real = os.path.realpath(head)
    if rest and not os.path.isdir(real):
        raise NotADirectoryError(errno.ENOTDIR, f"{real!r} in {text!r} is not a directory", text)
    if ".." in rest:
        missing = rest[rest.index("..") - 1]
        raise FileNotFoundError(
            errno.ENOENT, f"{missing!r} does not exist, so {missing + os.sep + '..'!r} in "
            f"{text!r} names no directory (paths are resolved as the kernel does, not as text)",
            text)
    return os.path.join(real, *rest)


REMOTE_SCHEME = "s3://"


def is_remote(path) -> bool:
    """Whether ``path`` names a place in an object store (``s3://bucket/prefix``), which is
    taken as it is written, not resolved as a local path."""
    return isinstance(path, str) and path.startswith(REMOTE_SCHEME)


def shown(path) -> str:
    """``path`` as gockpt prints and records it: absolute, an ``s3://`` URL as written."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def split_remote(url: str) -> tuple:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; ``ValueError`` for a URL that names no
    bucket or has empty, ``.`` or ``..`` components."""
    if not is_remote(url):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _, key = url[len(REMOTE_SCHEME):].partition("/")
    key = key.rstrip("/")
    if not bucket or any(c in bucket for c in "\\/ ") or (key and any(
            part in ("", ".", "..") for part in key.split("/"))):
        raise ValueError(f"{url!r} is not a valid s3://bucket/prefix URL")
    return bucket, key


def directory_to_read(path) -> str:
    """:func:`real_directory` for a directory to read checkpoints from (``gockpt.load``,
    ``gockpt.verify``): ``CheckpointNotFoundError`` saying why where it names none. An
    ``s3://`` URL is returned as written (without a trailing ``/``)."""
    if is_remote(path):
        return path.rstrip("/")
    try:
        return real_directory(path)
    except OSError as exc:
        raise CheckpointNotFoundError(f"checkpoint directory {os.fspath(path)!r} does not exist: "
                                      f"{exc.strerror}") from exc
