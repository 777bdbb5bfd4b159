"""Tests of gockpt.storage.format: checkpoint names, the safetensors-compatible aligned layout of the
data file, tensor entries."""

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from gockpt import storage
from gockpt.storage import format as fmt
from gockpt.storage import (
    CheckpointWriter,
    checkpoint_name,
    read_manifest,
)
from tests._support.storage_helpers import assert_same, odd_tensors, sample_tensors, save, save_with


# ------------------------------------------------------------------------ names


def test_checkpoint_name():
    assert checkpoint_name(120) == "step-000000120"
    assert checkpoint_name(0) < checkpoint_name(9) < checkpoint_name(10)
    with pytest.raises(ValueError):
        checkpoint_name(-1)


# ----------------------------------------------------------------------- layout


def test_write_returns_file_size_and_layout(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    n = w.write_tensors(sample_tensors())
    path = w.commit({})
    data = os.path.join(path, "data.safetensors")
    assert n == os.path.getsize(data)
    with open(data, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
    assert hlen % 8 == 0
    assert header["__metadata__"] == {"format": "gockpt"}
    # Contiguous, no holes: the data offsets tile the data section exactly.
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == n - 8 - hlen
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    m = read_manifest(path)
    for k, e in m["tensors"].items():
        assert e["offset"] == 8 + hlen + header[k]["data_offsets"][0]


def test_safetensors_can_read(tmp_path):
    tensors = sample_tensors()
    path = save(tmp_path, "a", tensors)
    with safe_open(os.path.join(path, "data.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {k for k in keys if not k.startswith("__pad__/")} == set(tensors)
        assert f.metadata() == {"format": "gockpt"}
        got = {k: f.get_tensor(k) for k in tensors}
        pads = [f.get_tensor(k) for k in keys if k.startswith("__pad__/")]
    assert_same(tensors, {k: got[k] for k in tensors})
    # The filler tensors are zero bytes, and only the manifest's tensors are gockpt's.
    assert pads and all(p.dtype == torch.uint8 and not p.any() for p in pads)
    assert set(read_manifest(path)["tensors"]) == set(tensors)


def test_safetensors_reads_every_real_tensor(tmp_path):
    tensors = odd_tensors()
    path, _ = save_with(tmp_path, "a", tensors)
    fpath = os.path.join(path, storage.DATA_FILE)
    with open(fpath, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
    assert (8 + hlen) % 4096 == 0  # data region starts aligned; JSON padded with spaces
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert 8 + hlen + spans[-1][1] == os.path.getsize(fpath)
    pads = [k for k in header if k.startswith(storage.PAD_PREFIX)]
    assert pads and all(header[k]["dtype"] == "U8" for k in pads)
    with safe_open(fpath, "pt") as f:
        assert {k for k in f.keys() if not k.startswith(storage.PAD_PREFIX)} == set(tensors)
        got = {k: f.get_tensor(k) for k in tensors}
    assert_same(tensors, got)


# ----------------------------------------------------------------------------- tensor entries


def test_tensor_entry_keeps_the_on_disk_chunk_key():
    e = fmt.tensor_entry("data.safetensors", "F32", (2, 3), 4096, 24, 8192, (7,))
    # format version 2: the chunk size is stored as "block_bytes"
    assert fmt.CHUNK_BYTES_KEY == "block_bytes"
    assert e == {"file": "data.safetensors", "dtype": "F32", "shape": [2, 3], "offset": 4096, "nbytes": 24,
                 "block_bytes": 8192, "crc32c": [7]}
    assert list(e) == ["file", "dtype", "shape", "offset", "nbytes", "block_bytes", "crc32c"]
    assert fmt.chunk_bytes_of(e) == 8192
    assert fmt.chunk_bytes_of({**e, "block_bytes": 100}) == fmt.CHUNK_BYTES


def test_check_tensor_entry():
    e = fmt.tensor_entry("data.safetensors", "F32", [2, 3], 4096, 24, 4096, [7])
    assert fmt.check_tensor_entry(e, lambda file: 8192) is None
    short = fmt.check_tensor_entry(e, lambda file: 4100)
    assert isinstance(short, fmt.FileProblem) and short.startswith("truncated: 4100 bytes")
    bad_chunk = {**e, "block_bytes": 100}
    assert fmt.check_tensor_entry(bad_chunk, lambda file: 8192).startswith("invalid block_bytes")
    assert fmt.check_tensor_entry(bad_chunk, lambda file: 8192, checksums=False) is None
    no_crcs = {k: v for k, v in e.items() if k != "crc32c"}
    assert fmt.check_tensor_entry(no_crcs, lambda file: 8192) == "missing fields ['crc32c']"
    assert fmt.check_tensor_entry(no_crcs, lambda file: 8192, checksums=False) is None
    assert fmt.check_tensor_entry({**e, "dtype": ["F32"]}, lambda file: 8192) == "unknown dtype ['F32']"

    def no_stat(file):
        raise AssertionError("size asked for a file name that is not plain")

    assert "plain file name" in fmt.check_tensor_entry({**e, "file": "../x"}, no_stat)
    assert "does not match shape" in fmt.check_tensor_entry({**e, "shape": [2**20, 2**20]}, no_stat)
    # more elements than torch can make, even empty: refused before any allocation
    for shape in ([2**40, 2**40], [0, 2**62], [0] + [2] * 70, [1] * 65):
        assert "invalid shape" in fmt.check_tensor_entry({**e, "shape": shape, "nbytes": 0},
                                                         no_stat)
