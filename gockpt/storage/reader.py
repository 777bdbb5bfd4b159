"""Reading a checkpoint back: the validated manifest, then tensors read in parallel by C++
threads (page cache or O_DIRECT chosen per tensor), every block's checksum verified.

The manifest is untrusted input: names, offsets and sizes are validated before anything is
allocated or read."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import mmap
import os

import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, LoadError
from . import io as _io
from .format import (ALIGN, BLOCK_BYTES, CODE_TO_DTYPE, FORMAT, FORMAT_VERSION, ITEMSIZE,
                     MANIFEST_FILE, check_checksums, is_plain_int, round_up)


def read_manifest(path: str) -> dict:
    """Read and validate ``<path>/manifest.json``.

    Checks the JSON, the format and version, and every tensor entry: the file
    is a plain name inside the checkpoint, the dtype is known, ``nbytes`` equals
    ``prod(shape) * itemsize`` and ``offset + nbytes`` lies within the file.
    Raises ``CheckpointNotFoundError`` if ``path`` is not a directory and
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

    sizes: dict[str, int] = {}  # file -> size, each file stat()ed once
    for name, e in tensors.items():

        def bad_tensor(msg: str) -> CorruptCheckpointError:
            file = e.get("file") if isinstance(e, dict) else None
            return bad(f"tensor {name!r} (file {file!r}): {msg}")

        if not isinstance(e, dict):
            raise bad_tensor("entry is not an object")
        missing = {"file", "dtype", "shape", "offset", "nbytes", "block_bytes", "crc32c"} - set(e)
        if missing:
            raise bad_tensor(f"missing fields {sorted(missing)}")
        file = e["file"]
        if not isinstance(file, str) or file in ("", ".", "..") or any(c in file for c in "/\\\0"):
            raise bad_tensor("file must be a plain file name inside the checkpoint directory")
        if e["dtype"] not in ITEMSIZE:
            raise bad_tensor(f"unknown dtype {e['dtype']!r}")
        shape = e["shape"]
        if not isinstance(shape, list) or not all(is_plain_int(d) for d in shape):
            raise bad_tensor(f"invalid shape {shape!r}")
        if not (is_plain_int(e["offset"]) and is_plain_int(e["nbytes"])):
            raise bad_tensor(f"invalid offset {e['offset']!r} or nbytes {e['nbytes']!r}")
        expected = math.prod(shape) * ITEMSIZE[e["dtype"]]  # Python ints: no overflow on absurd shapes
        if e["nbytes"] != expected:
            raise bad_tensor(f"nbytes {e['nbytes']} does not match shape {shape} of {e['dtype']} ({expected})")
        if file not in sizes:
            try:
                sizes[file] = os.stat(os.path.join(path, file)).st_size
            except OSError as err:
                raise bad_tensor(f"data file missing or unreadable: {err}") from err
        if e["offset"] + e["nbytes"] > sizes[file]:
            raise bad_tensor(
                f"bytes {e['offset']}..{e['offset'] + e['nbytes']} lie beyond the end of the file "
                f"({sizes[file]} bytes): the file is truncated"
            )
        problem = check_checksums(e)
        if problem:
            raise bad_tensor(problem)
    return manifest


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


_libc = None
_LOW_BIT = bytes(i & 1 for i in range(256))
# Residency is sampled: per item, up to _RES_SAMPLES windows of _RES_WINDOW pages, evenly spread.
_RES_SAMPLES = 16
_RES_WINDOW = 16


def _cached_items(fpath: str, items: list):
    """For each read item (offset, nbytes, ...): whether most of its pages are in the page cache,
    from mincore(2) on a read-only mapping of the file (sampled windows; nothing is read or
    faulted in). None if it cannot be asked (no mincore, mmap refused). Note: Linux reports
    page-cache state only to a process that owns the file or may write it; for others every
    item counts as not cached.
    """
    global _libc
    if not hasattr(os, "posix_fadvise"):  # POSIX systems with mincore only
        return None
    page = mmap.PAGESIZE
    lo = min(it[0] for it in items) // page * page
    hi = max(it[0] + it[1] for it in items)
    length = hi - lo
    if length <= 0:
        return None
    try:
        if _libc is None:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.mincore.restype = ctypes.c_int
            _libc = lib
        fd = os.open(fpath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            vec = ctypes.create_string_buffer(_RES_WINDOW)
            out = []
            for it in items:
                first = (it[0] - lo) // page
                npages = -(-(it[0] + it[1] - lo) // page) - first
                nwin = min(_RES_SAMPLES, -(-npages // _RES_WINDOW))
                resident = total = 0
                for j in range(nwin):
                    p0 = first + (npages - _RES_WINDOW) * j // max(1, nwin - 1) if npages > _RES_WINDOW else first
                    n = min(_RES_WINDOW, npages)
                    if _libc.mincore(addr + p0 * page, n * page, vec) != 0:
                        return None
                    resident += vec.raw[:n].translate(_LOW_BIT).count(1)
                    total += n
                out.append(2 * resident >= total)
            return out
        finally:
            _libc.munmap(addr, length)
    except (OSError, AttributeError, ValueError):
        return None


def _split_by_residency(fpath: str, items: list) -> list:
    """Split read ``items`` into [(indices, direct)] groups: items mostly in the page cache are read
    buffered (a memcpy from the cache, where O_DIRECT would read the disk again), the others with
    O_DIRECT (no second copy through the cache). Cached group first; file order within each."""
    cached = _cached_items(fpath, items)
    if cached is None:
        return [(list(range(len(items))), True)]
    groups = ([i for i, c in enumerate(cached) if c], False), ([i for i, c in enumerate(cached) if not c], True)
    return [g for g in groups if g[0]]


def read_tensors(path: str, manifest: dict, names=None, *, verify: bool = True, out: dict | None = None,
                 threads: int | None = None, direct: bool | None = None) -> dict:
    """Read tensors of checkpoint ``path`` into CPU tensors, in parallel.

    ``manifest`` is what ``read_manifest(path)`` returned (or its typed
    :class:`~gockpt.storage.manifest.Manifest`); ``names`` selects tensors
    (default: all). Tensors named in ``out`` (name -> CPU tensor of the stored dtype and
    shape) are read straight into those tensors (returned as the same objects); the others
    into new tensors. Every block's crc32c is checked unless ``verify=False``. Reads use
    ``threads`` threads (default: twice the cores / ``GOCKPT_IO_THREADS``). ``direct=None``
    (default): tensors whose bytes are mostly in the page cache (e.g. a restart right after the
    checkpoint was written, or a second read) are read buffered, the others with O_DIRECT;
    ``direct=True`` forces O_DIRECT, ``direct=False`` / ``GOCKPT_IO_DIRECT=0`` buffered reads.

    Raises ``CorruptCheckpointError`` naming the checkpoint, file and tensor (and the block) on
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
        fpath = os.path.join(path, file)
        try:
            size = os.stat(fpath).st_size
        except OSError as e:
            raise CorruptCheckpointError(
                f"checkpoint {path!r}: cannot open {file!r} (needed for tensor {file_names[0]!r}): {e}"
            ) from e
        # In file order, so the reads are roughly sequential.
        file_names = sorted(file_names, key=lambda n: entries[n]["offset"])
        items, item_names, copy_back = [], [], []
        for name in file_names:
            e = entries[name]

            def bad(msg: str) -> CorruptCheckpointError:
                return CorruptCheckpointError(f"checkpoint {path!r}: file {fpath!r}: tensor {name!r}: {msg}")

            offset, nbytes = e["offset"], e["nbytes"]
            # Checked before allocating (the manifest may not have been validated), so
            # damaged numbers cannot make us allocate more than the file holds.
            if e["dtype"] not in CODE_TO_DTYPE or not isinstance(e["shape"], list) or \
                    not all(is_plain_int(d) for d in e["shape"]):
                raise bad(f"invalid dtype {e['dtype']!r} or shape {e['shape']!r}")
            if not (is_plain_int(offset) and is_plain_int(nbytes)):
                raise bad(f"invalid offset {offset!r} or nbytes {nbytes!r}")
            if math.prod(e["shape"]) * ITEMSIZE[e["dtype"]] != nbytes:
                raise bad(f"nbytes {nbytes} does not match shape {e['shape']} of {e['dtype']}")
            if offset + nbytes > size:
                raise bad(f"bytes {offset}..{offset + nbytes} lie outside the file ({size} bytes): truncated")
            problem = check_checksums(e)
            if problem and verify:
                raise bad(problem)
            bb = e["block_bytes"] if not problem else BLOCK_BYTES
            dtype = CODE_TO_DTYPE[e["dtype"]]
            dst = out.get(name)
            if dst is not None:
                if not isinstance(dst, torch.Tensor) or dst.device.type != "cpu" or dst.layout != torch.strided:
                    raise LoadError(f"out[{name!r}] must be a dense CPU tensor, got {dst!r:.80}")
                if dst.dtype != dtype or list(dst.shape) != e["shape"]:
                    raise LoadError(f"checkpoint {path!r}: tensor {name!r} is {e['dtype']} {e['shape']}, "
                                    f"out[{name!r}] is {dst.dtype} {list(dst.shape)}")
                target = dst
                if not dst.is_contiguous():
                    target = torch.empty(e["shape"], dtype=dtype)
                    copy_back.append((dst, target))
            else:
                target = dst = _empty_for_read(e["shape"], dtype, nbytes)
            result[name] = dst
            if nbytes:
                items.append((offset, nbytes, target.data_ptr(), bb, list(e["crc32c"]) if verify else []))
                item_names.append(name)
        if items:
            if direct is None and _io.default_direct():
                groups = _split_by_residency(fpath, items)
            else:
                groups = [(list(range(len(items))), direct)]
            where = f"checkpoint {path!r}: file {fpath!r}"
            err = 0
            mismatches, truncated = [], []
            for idx, gdirect in groups:
                gerr, gmsg, gbad, _direct, gmis, gtrunc = _io.read_into(
                    fpath, [items[i] for i in idx], verify=verify, threads=threads, direct=gdirect)
                # Indices back to ``items``.
                truncated += [(idx[i], eof) for i, eof in gtrunc]
                mismatches += [(idx[i], k, got) for i, k, got in gmis]
                if gerr and not err:
                    err, msg, bad_item = gerr, gmsg, (idx[gbad] if gbad >= 0 else -1)
                if gerr or gtrunc:
                    break
            truncated.sort()
            mismatches.sort()
            if truncated:
                i, eof = truncated[0]
                raise CorruptCheckpointError(f"{where}: tensor {item_names[i]!r}: the file ended at byte {eof}: "
                                             "truncated")
            if err:
                tname = item_names[bad_item] if bad_item >= 0 else file_names[0]
                raise CorruptCheckpointError(f"{where}: tensor {tname!r}: {msg}") from OSError(err, msg)
            if mismatches:
                i, k, got = mismatches[0]
                off, n, _, bb, crcs = items[i]
                lo, hi = k * bb, min(n, (k + 1) * bb)
                more = f" ({len(mismatches) - 1} more damaged block(s))" if len(mismatches) > 1 else ""
                raise CorruptCheckpointError(
                    f"{where}: tensor {item_names[i]!r}: block {k} (bytes {lo}..{hi} of the tensor, "
                    f"file offset {off + lo}): checksum mismatch (crc32c {got:#010x}, expected "
                    f"{crcs[k]:#010x}): the data is corrupt{more}")
        for dst, tmp in copy_back:
            dst.copy_(tmp)
    return {name: result[name] for name in names}

