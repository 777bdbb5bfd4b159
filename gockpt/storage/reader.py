"""Reading a checkpoint back: the validated manifest, then tensors read in parallel by C++
threads (page cache or O_DIRECT chosen per tensor, :mod:`.pagecache`), every chunk's checksum
verified.

The manifest is untrusted input: names, offsets and sizes are validated
(:func:`~.format.check_tensor_entry`) before anything is allocated or read."""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, LoadError
from . import io as _io
from .format import (ALIGN, CODE_TO_DTYPE, FORMAT, FORMAT_VERSION, MANIFEST_FILE, check_tensor_entry,
                     chunk_bytes_of, is_plain_int, round_up)
from .pagecache import split_by_residency


def read_manifest(path: str) -> dict:
    """Read and validate ``<path>/manifest.json``.

    Checks the JSON, the format and version, and every tensor entry: the file
    is a plain name inside the checkpoint, the dtype is known, ``nbytes`` equals
    ``prod(shape) * itemsize``, ``offset + nbytes`` lies within the file and the chunk
    checksums fit. Raises ``CheckpointNotFoundError`` if ``path`` is not a directory and
    ``CorruptCheckpointError`` naming the checkpoint, file and tensor otherwise.
    """
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint {path!r} does not exist")
    mpath = os.path.join(path, MANIFEST_FILE)

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {path!r}: {MANIFEST_FILE}: {msg}")

    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise bad("missing (the checkpoint was not committed completely)") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"unreadable or not JSON: {e}") from e
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
        raise bad(f"format_version {version} was written by an older, pre-release gockpt "
                  f"(per-tensor crc32, unaligned); this gockpt reads format_version {FORMAT_VERSION} only")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("'tensors' is missing or not an object")
    _check_entries(path, tensors, bad)
    return manifest


def _check_entries(path: str, tensors: dict, bad) -> None:
    """Validate every tensor entry of a manifest, stat()ing each data file once."""
    sizes: dict[str, int] = {}  # file -> size
    for name, e in tensors.items():

        def bad_tensor(msg: str) -> CorruptCheckpointError:
            file = e.get("file") if isinstance(e, dict) else None
            return bad(f"tensor {name!r} (file {file!r}): {msg}")

        def size_of(file: str) -> int:
            if file not in sizes:
                try:
                    sizes[file] = os.stat(os.path.join(path, file)).st_size
                except OSError as err:
                    raise bad_tensor(f"data file missing or unreadable: {err}") from err
            return sizes[file]

        problem = check_tensor_entry(e, size_of)
        if problem:
            raise bad_tensor(problem)


# Fresh tensors of at least this size are allocated page-aligned (anonymous mmap, advised to
# use transparent huge pages): O_DIRECT reads land in them without a bounce copy, and
# faulting in 2 MiB pages costs far less than 4 KiB ones.

_MMAP_MIN_BYTES = 1 << 20


def _empty_for_read(shape: list, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    if nbytes < _MMAP_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, round_up(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape)


def read_tensors(path: str, manifest: dict, names=None, *, verify: bool = True, out: dict | None = None,
                 threads: int | None = None, direct: bool | None = None) -> dict:
    """Read tensors of checkpoint ``path`` into CPU tensors, in parallel.

    ``manifest`` is what ``read_manifest(path)`` returned (or its typed
    :class:`~gockpt.storage.manifest.Manifest`); ``names`` selects tensors
    (default: all). Tensors named in ``out`` (name -> CPU tensor of the stored dtype and
    shape) are read straight into those tensors (returned as the same objects); the others
    into new tensors. Every chunk's crc32c is checked unless ``verify=False``. Reads use
    ``threads`` threads (default: twice the cores / ``GOCKPT_IO_THREADS``). ``direct=None``
    (default): tensors whose bytes are mostly in the page cache (e.g. a restart right after the
    checkpoint was written, or a second read) are read buffered, the others with O_DIRECT;
    ``direct=True`` forces O_DIRECT, ``direct=False`` / ``GOCKPT_IO_DIRECT=0`` buffered reads.

    Raises ``CorruptCheckpointError`` naming the checkpoint, file and tensor (and the chunk) on
    a checksum mismatch, truncation, missing file or missing tensor; ``LoadError`` if an
    ``out`` tensor has another dtype or shape. After an error, the ``out`` tensors may hold
    partly read data.
    """
    entries = manifest.tensors if hasattr(manifest, "tensors") else manifest["tensors"]
    names = list(entries) if names is None else list(names)
    out = {} if out is None else out
    by_file: dict[str, list] = {}
    for name in names:
        if name not in entries:
            raise CorruptCheckpointError(f"checkpoint {path!r} has no tensor {name!r}")
        by_file.setdefault(entries[name]["file"], []).append(name)
    result = {}
    for file, file_names in by_file.items():
        reads = _plan_file(path, file, {n: entries[n] for n in file_names}, out, verify)
        if reads.items:
            _raise_for(reads, _run_reads(reads, verify, threads, direct))
        for dst, tmp in reads.copy_back:
            dst.copy_(tmp)
        result.update(reads.result)
    return {name: result[name] for name in names}


@dataclass
class _FileReads:
    """The reads of one data file: the items for ``_C.read_into`` in file order, the tensor each
    item is, and where the tensors go."""

    where: str  # "checkpoint ...: file ..." for messages
    fpath: str
    names: list  # the file's tensors, in file order
    items: list = field(default_factory=list)  # (offset, nbytes, address, chunk_bytes, crcs)
    item_names: list = field(default_factory=list)
    result: dict = field(default_factory=dict)  # name -> the tensor returned
    copy_back: list = field(default_factory=list)  # (out tensor, contiguous tensor read into)


def _plan_file(path: str, file: str, entries: dict, out: dict, verify: bool) -> _FileReads:
    """Validate the ``entries`` (name -> manifest entry) stored in ``file`` against the file as
    it is now (the manifest may not have been validated: nothing is allocated before), then
    find or allocate each tensor's destination."""
    fpath = os.path.join(path, file)
    try:
        size = os.stat(fpath).st_size
    except OSError as e:
        raise CorruptCheckpointError(
            f"checkpoint {path!r}: cannot open {file!r} (needed for tensor {next(iter(entries))!r}): {e}"
        ) from e
    where = f"checkpoint {path!r}: file {fpath!r}"
    for name, e in entries.items():
        problem = check_tensor_entry(e, lambda _file: size, checksums=verify)
        if problem:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: {problem}")
    # In file order, so the reads are roughly sequential.
    reads = _FileReads(where, fpath, sorted(entries, key=lambda n: entries[n]["offset"]))
    for name in reads.names:
        e = entries[name]
        target = _destination(path, name, e, out.get(name), reads)
        if e["nbytes"]:
            crcs = list(e["crc32c"]) if verify else []
            reads.items.append((e["offset"], e["nbytes"], target.data_ptr(), chunk_bytes_of(e), crcs))
            reads.item_names.append(name)
    return reads


def _destination(path: str, name: str, e: dict, dst, reads: _FileReads) -> torch.Tensor:
    """The contiguous tensor that the bytes of ``name`` are read into: ``dst`` (the caller's
    ``out`` tensor, checked), a contiguous stand-in copied back into it, or a new tensor."""
    dtype = CODE_TO_DTYPE[e["dtype"]]
    if dst is None:
        reads.result[name] = target = _empty_for_read(e["shape"], dtype, e["nbytes"])
        return target
    if not isinstance(dst, torch.Tensor) or dst.device.type != "cpu" or dst.layout != torch.strided:
        raise LoadError(f"out[{name!r}] must be a dense CPU tensor, got {dst!r:.80}")
    if dst.dtype != dtype or list(dst.shape) != e["shape"]:
        raise LoadError(f"checkpoint {path!r}: tensor {name!r} is {e['dtype']} {e['shape']}, "
                        f"out[{name!r}] is {dst.dtype} {list(dst.shape)}")
    reads.result[name] = dst
    if dst.is_contiguous():
        return dst
    target = torch.empty(e["shape"], dtype=dtype)
    reads.copy_back.append((dst, target))
    return target


@dataclass
class _ReadOutcome:
    """What the C++ reads of one file found, item indices into ``_FileReads.items``."""

    err: int = 0
    msg: str = ""
    bad_item: int = -1
    mismatches: list = field(default_factory=list)  # sorted (item, chunk, crc32c found)
    truncated: list = field(default_factory=list)  # sorted (item, file offset of the end of file)


def _run_reads(reads: _FileReads, verify: bool, threads, direct) -> _ReadOutcome:
    """Run the file's reads in C++: with ``direct=None``, the items mostly in the page cache
    buffered and the others with O_DIRECT (one call each); stops after a failed or short read."""
    items = reads.items
    if direct is None and _io.default_direct():
        groups = split_by_residency(reads.fpath, items)
    else:
        groups = [(list(range(len(items))), direct)]
    got = _ReadOutcome()
    for idx, gdirect in groups:
        res = _io.read_into(reads.fpath, [items[i] for i in idx], verify=verify, threads=threads,
                            direct=gdirect)
        # Indices back to ``items``.
        got.truncated += [(idx[i], eof) for i, eof in res.truncated]
        got.mismatches += [(idx[i], k, crc) for i, k, crc in res.mismatches]
        if res.err and not got.err:
            got.err, got.msg = res.err, res.msg
            got.bad_item = idx[res.bad_item] if res.bad_item >= 0 else -1
        if res.err or res.truncated:
            break
    got.truncated.sort()
    got.mismatches.sort()
    return got


def _raise_for(reads: _FileReads, got: _ReadOutcome) -> None:
    """Raise ``CorruptCheckpointError`` for the first problem the reads found (truncation, then
    a failed read, then checksum mismatches), naming the tensor; nothing if none."""
    where = reads.where
    if got.truncated:
        i, eof = got.truncated[0]
        raise CorruptCheckpointError(f"{where}: tensor {reads.item_names[i]!r}: the file ended at byte {eof}: "
                                     "truncated")
    if got.err:
        tname = reads.item_names[got.bad_item] if got.bad_item >= 0 else reads.names[0]
        raise CorruptCheckpointError(f"{where}: tensor {tname!r}: {got.msg}") from OSError(got.err, got.msg)
    if got.mismatches:
        # The message calls chunk k "block k": wording kept from format version 2's first
        # release, users and tests match it.
        i, k, crc = got.mismatches[0]
        off, n, _, cb, crcs = reads.items[i]
        lo, hi = k * cb, min(n, (k + 1) * cb)
        more = f" ({len(got.mismatches) - 1} more damaged block(s))" if len(got.mismatches) > 1 else ""
        raise CorruptCheckpointError(
            f"{where}: tensor {reads.item_names[i]!r}: block {k} (bytes {lo}..{hi} of the tensor, "
            f"file offset {off + lo}): checksum mismatch (crc32c {crc:#010x}, expected "
            f"{crcs[k]:#010x}): the data is corrupt{more}")
