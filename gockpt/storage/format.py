"""The on-disk format of one checkpoint: names, dtype codes, the data file's layout.

A checkpoint is a directory ``<root>/<name>`` holding

* ``data.safetensors``: every tensor, in the safetensors layout (8-byte little-endian header
  length, JSON header padded with spaces, then the raw little-endian data, contiguous and
  without holes), so that ``safetensors.safe_open`` and other tools can read it. For O_DIRECT,
  the JSON header is padded so that the data region starts at a multiple of 4096, every tensor
  starts at a multiple of 4096, and the gap after each tensor is covered by a zero-filled U8
  filler tensor ``__pad__/<n>`` (in the safetensors header, not in the manifest); the file
  size is a multiple of 4096.
* ``manifest.json``: ``{"format": "gockpt", "format_version": 2, "tensors": {name: {"file",
  "dtype", "shape", "offset", "nbytes", "block_bytes", "crc32c"}}, ...}`` plus gockpt's typed
  sections (:mod:`gockpt.storage.manifest`). ``offset`` is the absolute byte offset in
  ``file``; ``crc32c`` lists the crc32c (Castagnoli) of each ``block_bytes``-sized block of the
  tensor's bytes (the last one shorter), computed by the writer threads while the data passes.

``<root>/latest`` holds the name of the latest committed checkpoint (see :mod:`.commit`).
"""

from __future__ import annotations

import json
import os
import re

import torch

FORMAT = "gockpt"
FORMAT_VERSION = 2
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

# Checksum granularity: each tensor's bytes are checksummed (crc32c) per block of this many
# bytes, so that a damaged byte is located to a block and the reader verifies in parallel.
BLOCK_BYTES = 4 << 20
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
    # A name is a single path component: it must not escape the root, hide
    # (names starting with '.' are reserved for temporaries) or shadow `latest`.
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or name == LATEST_FILE
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(f"invalid {what} {name!r}: use a plain file name such as 'step-000000120'")


def fsync_dir(path: str) -> None:
    """fsync a directory, so that the entries created or renamed in it are durable."""
    if os.name == "nt":
        return  # Windows cannot open a directory as a file; its renames are journaled anyway
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
    return type(x) is int and x >= 0


def check_checksums(e: dict) -> str | None:
    """What is wrong with the block_bytes / crc32c fields of entry ``e`` (None if fine)."""
    bb, crcs = e.get("block_bytes"), e.get("crc32c")
    if not (is_plain_int(bb) and bb > 0 and bb % ALIGN == 0):
        return f"invalid block_bytes {bb!r} (a positive multiple of {ALIGN})"
    if not isinstance(crcs, list):
        return f"invalid crc32c {crcs!r:.60} (a list of block checksums)"
    nblocks = -(-e["nbytes"] // bb)
    if len(crcs) != nblocks:
        return f"crc32c lists {len(crcs)} block checksums, {e['nbytes']} bytes in blocks of {bb} need {nblocks}"
    if not all(is_plain_int(c) and c < 2**32 for c in crcs):
        return "invalid crc32c: block checksums must be ints in [0, 2**32)"
    return None

