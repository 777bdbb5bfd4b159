"""A checkpoint's ``manifest.json``, read as untrusted input: its file size-bounded
(:func:`read_small_file`, which ``latest`` and the memory tier's ``run`` file use too), its
seal checked, its format version and every tensor entry's name, offset and size validated
(:func:`~.format.check_tensor_entry`) before anything is allocated or read
(:func:`read_manifest`). The tensors themselves are :mod:`.reader`'s."""

from __future__ import annotations

import json
import os
import stat

from ..core.errors import CheckpointNotFoundError, CorruptCheckpointError
from ..core.paths import is_remote
from . import remote
from .format import (FORMAT, FORMAT_VERSION, MANIFEST_FILE, MANIFEST_MAX_BYTES, FileProblem,
                     check_tensor_entry, is_plain_int, manifest_seal)


def read_small_file(path: str, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (links followed) of at most ``limit`` bytes.

    Never blocks and never reads without end: a FIFO, a device, a directory or a socket is
    refused (opened non-blocking, checked by fstat), and so is a file over ``limit``.
    Raises FileNotFoundError if it does not exist, ``ValueError`` saying what is wrong with
    it (``what`` names it), OSError otherwise."""
    if is_remote(path):
        return remote.read_small(path, limit, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size > limit:
            raise ValueError(f"{what} is {st.st_size} bytes, more than the {limit} a valid one "
                             "can be")
        chunks, left = [], limit + 1
        while left > 0:  # the size may change under us: read at most limit + 1
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise ValueError(f"{what} grew beyond {limit} bytes while being read")
        return data
    finally:
        os.close(fd)


def read_manifest(path: str) -> dict:
    """Read and validate ``<path>/manifest.json``.

    Checks that it is a regular file of sane size, its seal (the crc32c of its bytes,
    :func:`~.format.seal_manifest`) before anything is parsed, the JSON, the format and
    version, and every tensor entry: the file is a plain name inside the checkpoint, the dtype
    is known, ``nbytes`` equals ``prod(shape) * itemsize``, ``offset + nbytes`` lies within
    the file and the chunk checksums fit. Raises ``CheckpointNotFoundError`` if ``path`` is
    not a directory and ``CorruptCheckpointError`` naming the checkpoint, file and tensor
    otherwise.
    """
    in_store = is_remote(path)
    if not in_store and not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint {path!r} does not exist")
    mpath = os.path.join(path, MANIFEST_FILE)

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {path!r}: {MANIFEST_FILE}: {msg}")

    try:
        data = read_small_file(mpath, MANIFEST_MAX_BYTES, MANIFEST_FILE)
    except FileNotFoundError:
        if in_store:  # no directories in a store: no manifest, no checkpoint
            raise CheckpointNotFoundError(f"checkpoint {path!r} does not exist (no "
                                          f"{MANIFEST_FILE} in the store)") from None
        raise bad("missing (the checkpoint was not committed completely)") from None
    except (OSError, ValueError) as e:
        raise bad(f"unreadable: {e}") from e
    if manifest_seal(data) is None:
        raise bad(_unsealed(data))
    try:
        manifest = json.loads(data.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"not JSON: {e}") from e
    except RecursionError:
        raise bad("nested too deeply to be a manifest") from None
    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if manifest.get("format") != FORMAT:
        raise bad(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    if not is_plain_int(version):
        raise bad(f"invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise bad(f"format_version {version} is newer than this gockpt supports ({FORMAT_VERSION}); upgrade gockpt")
    if version < FORMAT_VERSION:
        raise bad(f"format_version {version} was written by an older, pre-release gockpt; this "
                  f"gockpt reads format_version {FORMAT_VERSION} only")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("'tensors' is missing or not an object")
    _check_entries(path, tensors, bad)
    return manifest


def _unsealed(data: bytes) -> str:
    """Why manifest bytes ``data`` have no valid seal."""
    try:
        version = json.loads(data.decode("utf-8")).get("format_version")
    except (ValueError, RecursionError, AttributeError):
        version = None
    if is_plain_int(version) and version < FORMAT_VERSION:
        return (f"format_version {version} was written by an older, pre-release gockpt (a "
                f"manifest without a seal); this gockpt reads format_version {FORMAT_VERSION} only")
    return ("damaged: its bytes do not match its seal (the crc32c it was written with); no "
            "value of it can be trusted -- load another checkpoint (tag=...)")


def _check_entries(path: str, tensors: dict, bad) -> None:
    """Validate every tensor entry of a manifest, stat()ing each data file once."""
    sizes: dict[str, int] = {}  # file -> size
    for name, e in tensors.items():

        def bad_tensor(msg: str) -> CorruptCheckpointError:
            file = e.get("file") if isinstance(e, dict) else None
            return bad(f"tensor {name!r} (file {file!r}): {msg}")

        def bad_file(file: str, msg: str) -> CorruptCheckpointError:
            # the data file is damaged, not the manifest: named as such
            return CorruptCheckpointError(f"checkpoint {path!r}: {file}: {msg} (tensor "
                                          f"{name!r})")

        def size_of(file: str) -> int:
            if file not in sizes and is_remote(path):
                try:  # (a store that cannot be reached raises StorageError: no damage)
                    sizes[file] = remote.size_of(os.path.join(path, file))
                except OSError as err:
                    raise bad_file(file, f"data object missing or unreadable: {err}") from err
            if file not in sizes:
                try:
                    st = os.stat(os.path.join(path, file))
                except OSError as err:
                    raise bad_file(file, f"data file missing or unreadable: {err}") from err
                if not stat.S_ISREG(st.st_mode):
                    raise bad_file(file, f"data file is not a regular file "
                                         f"({stat.filemode(st.st_mode)})")
                sizes[file] = st.st_size
            return sizes[file]

        problem = check_tensor_entry(e, size_of)
        if isinstance(problem, FileProblem):
            raise bad_file(e["file"], problem)
        if problem:
            raise bad_tensor(problem)


# Fresh tensors of at least this size are allocated page-aligned (anonymous mmap): O_DIRECT
# reads land in them without a bounce copy. Not advised to use transparent huge pages: memory
# touched for the first time (a restart) faulted in 2 MiB pages was 4x slower than in 4 KiB
# ones on the VMs measured (0.8-1.0 GB/s against 3.8-4.0 for 2.3 GB read from the page
# cache, experiments/bench_storage.py's "into fresh tensors"); the kernel's own THP policy
# still applies.
