"""The on-disk format of one checkpoint: names, dtype codes, the data file's layout.

A checkpoint is a directory ``<root>/<name>`` holding

* ``data.safetensors``: every tensor, in the safetensors layout (8-byte little-endian header
  length, JSON header padded with spaces, then the raw little-endian data, contiguous and
  without holes), so that ``safetensors.safe_open`` and other tools can read it. For O_DIRECT,
  the JSON header is padded so that the data region starts at a multiple of 4096, every tensor
  starts at a multiple of 4096, and the gap after each tensor is covered by a zero-filled U8
  filler tensor ``__pad__/<n>`` (in the safetensors header, not in the manifest); the file
  size is a multiple of 4096.
* ``manifest.json``: ``{"manifest_crc32c": "<8 hex>", "format": "gockpt", "format_version": 3,
  "tensors": {name: {"file", "dtype", "shape", "offset", "nbytes", "block_bytes", "crc32c"}},
  ...}`` plus gockpt's typed sections (:mod:`gockpt.storage.manifest`). The first member seals
  the manifest: the crc32c of every byte after it (:func:`seal_manifest`), checked before any
  value is trusted, so that a damaged manifest is named as such. ``offset`` is the absolute byte offset in
  ``file``; ``crc32c`` lists the crc32c (Castagnoli) of each chunk of the tensor's bytes (the
  last one shorter), computed by the writer threads while the data passes. The chunk size is
  stored under the historical key ``"block_bytes"`` (see :data:`CHUNK_BYTES_KEY`).

``<root>/latest`` holds the name of the latest committed checkpoint and, on a second line, the
seal of its manifest (see :mod:`.commit`): a damaged pointer, or one naming another checkpoint,
does not match.

This module owns these names, the layout of the data file (:func:`layout_file`) and the shape
of a tensor entry: :func:`tensor_entry` builds one, :func:`check_tensor_entry` validates one.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

from .io import crc32c

FORMAT = "gockpt"
FORMAT_VERSION = 3  # 3: the manifest is sealed (2: unsealed; 1: per-tensor crc32, unaligned)
DATA_FILE = "data.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"

# torch dtype <-> safetensors dtype code. The first ten are the ones gockpt
# promises; the rest are safetensors codes that cost nothing to support.
DTYPE_TO_CODE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_TO_CODE.items()}
ITEMSIZE = {code: dtype.itemsize for dtype, code in DTYPE_TO_CODE.items()}

# Checksum granularity: each tensor's bytes are checksummed (crc32c) per chunk of this many
# bytes, so that a damaged byte is located to a chunk and the reader verifies in parallel.
CHUNK_BYTES = 4 << 20
# The manifest's tensor entries store the chunk size under the key "block_bytes": files of
# format version 2 exist with that name, so it stays on disk. This is the one place that maps
# it; code says chunk (a "block" is the copy/replay unit of training state).
CHUNK_BYTES_KEY = "block_bytes"
# The fields of a tensor entry: where its bytes are and what they are, then their checksums.
LAYOUT_FIELDS = ("file", "dtype", "shape", "offset", "nbytes")
CHECKSUM_FIELDS = (CHUNK_BYTES_KEY, "crc32c")
# A stored tensor has at most this many dimensions, and fewer than 2**62 elements even where
# a zero dimension makes it empty (torch cannot make one of more).
MAX_DIMS = 64
# Every tensor starts at a multiple of ALIGN in data.safetensors (O_DIRECT needs it).
ALIGN = 4096
# Names of the filler tensors that keep the safetensors data region free of holes.
PAD_PREFIX = "__pad__/"

# .tmp-<name>-<pid>-<random>; <name> may itself contain '-', hence the greedy (.+).
TMP_RE = re.compile(r"^\.tmp-(.+)-(\d+)-([0-9a-f]+)$")


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint of training step ``step``, e.g. ``step-000000120``.

    Zero-padded so that names sort in step order.
    """
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:09d}"


def check_name(name: str, what: str = "checkpoint name") -> None:
    """Raise ``ValueError`` unless ``name`` is a plain checkpoint name.

    A name is a single path component: it must not escape the root, hide (names starting
    with '.' are reserved for temporaries), shadow ``latest``, or be a string the file
    system cannot take (a lone surrogate has no UTF-8 encoding; longer than a file name).
    """
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or name == LATEST_FILE
        or "/" in name
        or "\\" in name
        or "\0" in name
        or not _encodable(name)
    ):
        raise ValueError(f"invalid {what} {name!r:.80}: use a plain file name such as "
                         "'step-000000120'")


def _encodable(name: str) -> bool:
    try:
        return len(os.fsencode(name)) <= 255 and len(name.encode("utf-8")) <= 255
    except UnicodeError:
        return False


# ------------------------------------------------------------------ sealed small files

# The manifest begins with its seal: {"manifest_crc32c":"<8 hex>", then the rest of the object,
# whose bytes the crc32c covers. A fixed place, so that the seal is checked on the raw bytes
# before anything is parsed.
SEAL_KEY = "manifest_crc32c"
_SEAL_HEAD = b'{"' + SEAL_KEY.encode() + b'":"'
_SEALED_AT = len(_SEAL_HEAD) + 8 + 2  # the head, 8 hex digits, '",'
MANIFEST_MAX_BYTES = 1 << 30  # the manifest of a 10,000-tensor model is a few MB
LATEST_MAX_BYTES = 4096


def seal_manifest(obj: dict) -> bytes:
    """The bytes of ``manifest.json`` for the JSON object ``obj`` (compact), sealed."""
    # Compact: the C encoder (an indent makes json fall back to pure Python, slow on the
    # large manifests of models with thousands of parameters, holding the GIL).
    return seal_json(json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def seal_json(text: bytes) -> bytes:
    """The JSON object ``text`` (starting ``{"``) with its seal as the first member."""
    if not text.startswith(b'{"'):
        raise ValueError("a manifest is a non-empty JSON object")
    body = text[1:]
    return _SEAL_HEAD + b"%08x" % crc32c(body) + b'",' + body


def manifest_seal(data: bytes) -> str | None:
    """The seal of manifest bytes ``data`` if it matches them, else None (damaged, or not
    sealed)."""
    if len(data) <= _SEALED_AT or not data.startswith(_SEAL_HEAD) \
            or data[_SEALED_AT - 2:_SEALED_AT] != b'",':
        return None
    seal = data[len(_SEAL_HEAD):_SEALED_AT - 2]
    try:
        want = int(seal, 16)
    except ValueError:
        return None
    if seal != seal.lower() or want != crc32c(data[_SEALED_AT:]):
        return None
    return seal.decode("ascii")




def fsync_dir(path: str) -> None:
    """fsync a directory, so that the entries created or renamed in it are durable."""
    if os.name == "nt":
        return  # Windows cannot open a directory as a file; its renames are journaled anyway
    fsync_path(path)


def fsync_path(path: str) -> None:
    """fsync a file (or, on POSIX, a directory) by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data) -> None:
    """os.write until all of ``data`` is written (os.write may write less)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def round_up(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def layout_file(items: list) -> tuple:
    """File layout of ``items`` [(name, code, shape, nbytes)] in safetensors form.

    Returns (header bytes incl. the 8-byte length, {name: absolute offset}, file size). The
    JSON header is padded with spaces so that the data region starts at a multiple of ALIGN;
    each tensor starts at a multiple of ALIGN, the gap after it is covered by a U8 filler
    tensor ``__pad__/<n>`` (safetensors wants the data region without holes), and the file
    ends on a multiple of ALIGN.
    """
    header: dict = {}
    rel: dict = {}
    pos = 0
    npad = 0
    for name, code, shape, nbytes in items:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        end = pos + nbytes
        gap = -end % ALIGN
        if gap:
            header[f"{PAD_PREFIX}{npad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [end, end + gap]}
            npad += 1
        pos = end + gap
    header["__metadata__"] = {"format": FORMAT}
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    data_start = round_up(8 + len(head), ALIGN)
    head += b" " * (data_start - 8 - len(head))
    offsets = {name: data_start + r for name, r in rel.items()}
    return len(head).to_bytes(8, "little") + head, offsets, data_start + pos


def is_plain_int(x) -> bool:
    """Whether ``x`` is a non-negative int (not a bool, not a float)."""
    return type(x) is int and x >= 0


def tensor_entry(file: str, code: str, shape: list, offset: int, nbytes: int, chunk_bytes: int,
                 crcs: list) -> dict:
    """The manifest entry of one stored tensor (``crcs``: the crc32c of each chunk)."""
    return {"file": file, "dtype": code, "shape": list(shape), "offset": offset, "nbytes": nbytes,
            CHUNK_BYTES_KEY: chunk_bytes, "crc32c": list(crcs)}


def chunk_bytes_of(e: dict) -> int:
    """The chunk size of tensor entry ``e``, or :data:`CHUNK_BYTES` where its field is unusable
    (tolerated only when the checksums are not verified)."""
    cb = e.get(CHUNK_BYTES_KEY)
    return cb if is_plain_int(cb) and cb > 0 and cb % ALIGN == 0 else CHUNK_BYTES


class FileProblem(str):
    """A problem :func:`check_tensor_entry` finds in the data file an entry points into (it is
    shorter than the entry says), not in the manifest itself."""


def check_tensor_entry(e, size_of, *, checksums: bool = True) -> str | None:
    """What is wrong with the manifest's tensor entry ``e`` (None if nothing).

    Checks, in this order: ``e`` is an object with the fields (the checksum fields only with
    ``checksums``); ``file`` is a plain file name inside the checkpoint; the dtype is known;
    shape, offset and nbytes are non-negative ints with ``nbytes == prod(shape) * itemsize``;
    ``offset + nbytes`` lies within the file, whose size ``size_of(file)`` gives (called only
    once the name is known to be plain; it may raise); with ``checksums``, the chunk size and
    crc32c list (:func:`check_checksums`). Python ints, nothing allocated: safe on untrusted,
    absurd numbers.
    """
    if not isinstance(e, dict):
        return "entry is not an object"
    missing = set(LAYOUT_FIELDS + (CHECKSUM_FIELDS if checksums else ())) - set(e)
    if missing:
        return f"missing fields {sorted(missing)}"
    file = e["file"]
    if not isinstance(file, str) or file in ("", ".", "..") or any(c in file for c in "/\\\0") \
            or not _encodable(file):
        return "file must be a plain file name inside the checkpoint directory"
    code, shape, offset, nbytes = e["dtype"], e["shape"], e["offset"], e["nbytes"]
    if not isinstance(code, str) or code not in ITEMSIZE:
        return f"unknown dtype {code!r}"
    if not isinstance(shape, list) or not all(is_plain_int(d) for d in shape) \
            or len(shape) > MAX_DIMS or math.prod(d for d in shape if d) >= 2**62:
        return f"invalid shape {shape!r:.80}"
    if not (is_plain_int(offset) and is_plain_int(nbytes)):
        return f"invalid offset {offset!r} or nbytes {nbytes!r}"
    expected = math.prod(shape) * ITEMSIZE[code]
    if nbytes != expected:
        return f"nbytes {nbytes} does not match shape {shape} of {code} ({expected})"
    size = size_of(file)
    if offset + nbytes > size:
        return FileProblem(f"truncated: {size} bytes, where the manifest places bytes "
                           f"{offset}..{offset + nbytes}")
    return check_checksums(e) if checksums else None


def check_checksums(e: dict) -> str | None:
    """What is wrong with the chunk size / crc32c fields of entry ``e`` (None if fine).

    The messages name the on-disk key and say "block checksums" (unchanged wording).
    """
    cb, crcs = e.get(CHUNK_BYTES_KEY), e.get("crc32c")
    if not (is_plain_int(cb) and cb > 0 and cb % ALIGN == 0):
        return f"invalid {CHUNK_BYTES_KEY} {cb!r} (a positive multiple of {ALIGN})"
    if not isinstance(crcs, list):
        return f"invalid crc32c {crcs!r:.60} (a list of block checksums)"
    nchunks = -(-e["nbytes"] // cb)
    if len(crcs) != nchunks:
        return (f"crc32c lists {len(crcs)} block checksums, {e['nbytes']} bytes in blocks of {cb} "
                f"need {nchunks}")
    if not all(is_plain_int(c) and c < 2**32 for c in crcs):
        return "invalid crc32c: block checksums must be ints in [0, 2**32)"
    return None
