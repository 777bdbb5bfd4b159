"""Reading a checkpoint's tensors back, after its manifest was read and validated
(:mod:`.manifest_file`): in parallel by C++ threads (page cache or O_DIRECT chosen per tensor,
:mod:`.pagecache`), every chunk's checksum verified."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import torch

from ..core.errors import CorruptCheckpointError, LoadError
from ..core.paths import is_remote
from . import io as _io
from . import remote
from .format import (ALIGN, CHUNK_BYTES, CHUNK_BYTES_KEY, CODE_TO_DTYPE, ITEMSIZE, check_tensor_entry,
                     round_up)
from .pagecache import split_by_residency


_MMAP_MIN_BYTES = 1 << 20


def _empty_for_read(shape: list, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    if nbytes < _MMAP_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, round_up(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
    first_chunks: list = field(default_factory=list)  # of each item: its first chunk's number
    result: dict = field(default_factory=dict)  # name -> the tensor returned
    copy_back: list = field(default_factory=list)  # (out tensor, contiguous tensor read into)

    def add(self, name: str, offset: int, nbytes: int, address: int, chunk: int, crcs: list,
            first_chunk: int = 0) -> None:
        """One read: ``nbytes`` of tensor ``name`` from file ``offset`` to ``address``,
        from the tensor's chunk ``first_chunk`` on (a part of the tensor: :func:`read_spans`)."""
        self.items.append((offset, nbytes, address, chunk, crcs))
        self.item_names.append(name)
        self.first_chunks.append(first_chunk)


def _checked_file(path: str, file: str, entries: dict, verify: bool) -> _FileReads:
    """The reads of ``file`` (none planned yet), once the ``entries`` (name -> manifest entry)
    stored in it are validated against the file as it is now (the manifest may not have been
    validated: nothing is allocated before)."""
    fpath = os.path.join(path, file)
    try:
        size = remote.size_of(fpath) if is_remote(fpath) else os.stat(fpath).st_size
    except OSError as e:
        raise CorruptCheckpointError(
            f"checkpoint {path!r}: cannot open {file!r} (needed for tensor {next(iter(entries))!r}): {e}"
        ) from e
    where = f"checkpoint {path!r}: file {fpath!r}"
    for name, e in entries.items():
        problem = check_tensor_entry(e, lambda _file: size, checksums=verify) or _io_range_problem(e, verify)
        if problem:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: {problem}")
    # In file order, so the reads are roughly sequential.
    return _FileReads(where, fpath, sorted(entries, key=lambda n: entries[n]["offset"]))


def _plan_file(path: str, file: str, entries: dict, out: dict, verify: bool) -> _FileReads:
    """The reads of the whole ``entries`` stored in ``file``, each tensor's destination found
    or allocated."""
    reads = _checked_file(path, file, entries, verify)
    for name in reads.names:
        e = entries[name]
        target = _destination(path, name, e, out.get(name), reads)
        if e["nbytes"]:
            # Unverified, the chunk is only the unit of work: the manifest's is not trusted.
            chunk, crcs = (e[CHUNK_BYTES_KEY], list(e["crc32c"])) if verify else (CHUNK_BYTES, [])
            reads.add(name, e["offset"], e["nbytes"], target.data_ptr(), chunk, crcs)
    return reads


def read_spans(path: str, manifest: dict, spans: dict, *, verify: bool = True,
               threads: int | None = None, direct: bool | None = None) -> dict:
    """Read only some elements of tensors of checkpoint ``path``: ``spans`` maps a stored name
    to the ranges ``[(lo, hi)]`` of its flat elements wanted. Each range is widened to whole
    checksum chunks (so that every byte read is verified: unless ``verify=False``, each
    chunk's crc32c is checked), and ranges that then overlap or touch are read once.

    Returns stored name -> ``[(first element, 1-D tensor of the elements read from it)]``, one
    per run read, in order; every wanted range lies inside one of them. Raises as
    :func:`read_tensors` does.
    """
    entries = manifest.tensors if hasattr(manifest, "tensors") else manifest["tensors"]
    by_file: dict[str, list] = {}
    for name in spans:
        if name not in entries:
            raise CorruptCheckpointError(f"checkpoint {path!r} has no tensor {name!r}")
        by_file.setdefault(entries[name]["file"], []).append(name)
    result: dict = {}
    for file, file_names in by_file.items():
        reads = _checked_file(path, file, {n: entries[n] for n in file_names}, verify)
        for name in reads.names:
            e = entries[name]
            dtype, itemsize = CODE_TO_DTYPE[e["dtype"]], ITEMSIZE[e["dtype"]]
            # the unit a run is widened to: a checksum chunk (verified); unverified, the
            # manifest's chunk size is not trusted, and O_DIRECT needs only aligned reads
            unit = e[CHUNK_BYTES_KEY] if verify else ALIGN
            result[name] = runs = []
            for lo, hi in _byte_runs(spans[name], itemsize, unit, e["nbytes"]):
                buf = _empty_for_read([hi - lo], torch.uint8, hi - lo)
                first = lo // unit
                crcs = list(e["crc32c"])[first:first + -(-(hi - lo) // unit)] if verify else []
                reads.add(name, e["offset"] + lo, hi - lo, buf.data_ptr(),
                          unit if verify else CHUNK_BYTES, crcs, first_chunk=first)
                runs.append((lo // itemsize, buf.view(dtype)))
        if reads.items:
            _raise_for(reads, _run_reads(reads, verify, threads, direct))
    return result


def _byte_runs(spans, itemsize: int, unit: int, nbytes: int) -> list:
    """The element ranges ``spans`` as byte ranges widened to multiples of ``unit`` (the last
    ending at ``nbytes``), sorted, those that overlap or touch merged; empty ones dropped."""
    runs: list = []
    for lo, hi in sorted((lo * itemsize // unit * unit, min(nbytes, -(-hi * itemsize // unit) * unit))
                         for lo, hi in spans if hi > lo):
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return [tuple(r) for r in runs]


# The C++ reader takes offsets, sizes and chunk sizes as unsigned 64-bit numbers and reads at
# signed 64-bit file offsets (off_t): from 2**63 on, a number is refused here, not wrapped there
# (a chunk size of 2**64 - 4096 once made its chunk count 0: the tensor was neither read nor
# checksummed).
_IO_LIMIT = 2**63


def _io_range_problem(e: dict, verify: bool) -> str | None:
    """What in entry ``e`` (checked by ``check_tensor_entry``) the C++ reader cannot take."""
    if e["offset"] + e["nbytes"] >= _IO_LIMIT:
        return f"bytes {e['offset']}..{e['offset'] + e['nbytes']} lie beyond the largest file offset"
    if verify and e[CHUNK_BYTES_KEY] >= _IO_LIMIT:
        return f"invalid {CHUNK_BYTES_KEY} {e[CHUNK_BYTES_KEY]} (a chunk size below 2**63)"
    return None


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
    if is_remote(reads.fpath):  # ranged GETs, in parallel, straight into the tensors
        bucket, key = remote.bucket_of(reads.fpath)
        res = bucket.read_into(key, items, verify=verify)
        return _ReadOutcome(res.err, res.msg, res.bad_item, res.mismatches, res.truncated)
    if direct is None and _io.default_direct():
        groups = split_by_residency(reads.fpath, items)
    else:
        groups = [(list(range(len(items))), direct)]
    got = _ReadOutcome()
    for idx, gdirect in groups:
        try:
            res = _io.read_into(reads.fpath, [items[i] for i in idx], verify=verify, threads=threads,
                                direct=gdirect)
        except (TypeError, OverflowError) as exc:  # a number the binding's types do not hold
            raise CorruptCheckpointError(f"{reads.where}: tensor {reads.item_names[_unfit_item(items)]!r}: "
                                         "an offset, size, chunk size or checksum out of the reader's "
                                         "range") from exc
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


def _unfit_item(items: list) -> int:
    """The first read item with a number outside the C++ reader's types (else 0)."""
    for i, (offset, nbytes, _, chunk, crcs) in enumerate(items):
        if not all(type(x) is int and 0 <= x < 2**64 for x in (offset, nbytes, chunk)) \
                or not all(type(c) is int and 0 <= c < 2**32 for c in crcs):
            return i
    return 0


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
        lo, hi = k * cb, min(n, (k + 1) * cb)  # of the item
        base = reads.first_chunks[i] * cb  # the item's first byte in the tensor
        more = f" ({len(got.mismatches) - 1} more damaged block(s))" if len(got.mismatches) > 1 else ""
        raise CorruptCheckpointError(
            f"{where}: tensor {reads.item_names[i]!r}: block {reads.first_chunks[i] + k} (bytes "
            f"{base + lo}..{base + hi} of the tensor, file offset {off + lo}): checksum mismatch "
            f"(crc32c {crc:#010x}, expected {crcs[k]:#010x}): the data is corrupt{more}")
