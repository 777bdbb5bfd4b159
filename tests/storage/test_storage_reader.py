"""Tests of gockpt.storage.reader: manifest validation, reads into out tensors, corruption and
truncation named down to tensor and chunk."""

import json
import os

import pytest
import torch

from gockpt import storage
from gockpt.errors import CheckpointNotFoundError, CorruptCheckpointError, LoadError
from gockpt.storage import (
    read_manifest,
    read_tensors,
)
from storage_helpers import (MiB, assert_same, bits, flip_byte, odd_tensors,
                             sample_tensors, save, save_with)


# --------------------------------------------------------------------- manifest


def test_missing_or_invalid_manifest(tmp_path):
    path = save(tmp_path, "a")
    mpath = os.path.join(path, "manifest.json")
    with open(mpath, "w") as f:
        f.write('{"format": "gockpt", ')
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        read_manifest(path)
    with open(mpath, "w") as f:
        json.dump({"format": "gockpt", "format_version": 99, "tensors": {}}, f)
    with pytest.raises(CorruptCheckpointError, match="newer"):
        read_manifest(path)
    os.remove(mpath)
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        read_manifest(path)
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(os.path.join(str(tmp_path), "nope"))


def test_old_format_version_refused(tmp_path):
    path, _ = save_with(tmp_path, "a", {"x": torch.ones(1)})
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["format_version"] = 1
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(CorruptCheckpointError, match="format_version 1"):
        read_manifest(path)


def test_manifest_crc_list_length_must_match(tmp_path):
    path, _ = save_with(tmp_path, "a", {"big": torch.randn(3 * MiB)})
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["tensors"]["big"]["crc32c"].pop()
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(CorruptCheckpointError, match="'big'.*need 3"):
        read_manifest(path)
    with pytest.raises(CorruptCheckpointError, match="'big'"):
        read_tensors(path, m)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("file", "../x", "plain file name"),
        ("file", "sub/data.safetensors", "plain file name"),
        ("file", "..", "plain file name"),
        ("offset", 10**12, "beyond the end"),
        ("nbytes", 2**62, "does not match shape"),
        ("shape", [2**31, 2**31], "does not match shape"),
        ("dtype", "F128", "unknown dtype"),
        ("shape", [-1], "invalid shape"),
        ("offset", -8, "invalid offset"),
        ("crc32c", "abc", "invalid crc32c"),
        ("crc32c", [], "block checksums"),
        ("crc32c", [2**32], "invalid crc32c"),
        ("block_bytes", 1000, "invalid block_bytes"),
        ("block_bytes", 0, "invalid block_bytes"),
    ],
)
def test_bad_manifest_entry(tmp_path, monkeypatch, field, value, message):
    path = save(tmp_path, "a")
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["tensors"]["f32"][field] = value
    if field == "shape" and value != [-1]:
        m["tensors"]["f32"]["nbytes"] = 2**62 * 4  # consistent with the shape, far beyond the file
        message = "beyond the end"
    with open(mpath, "w") as f:
        json.dump(m, f)

    # No allocation must be attempted from the bad numbers.
    def no_alloc(*a, **k):
        raise AssertionError("allocated a tensor from an invalid manifest")

    monkeypatch.setattr(storage.reader.torch, "empty", no_alloc)
    with pytest.raises(CorruptCheckpointError, match=message) as exc:
        read_manifest(path)
    assert "'f32'" in str(exc.value) and path in str(exc.value)
    # read_tensors given the bad manifest without validation must not allocate either.
    if field in ("offset", "nbytes") or (field == "shape" and value != [-1]):
        with pytest.raises(CorruptCheckpointError, match="'f32'"):
            read_tensors(path, m, ["f32"])


# ---------------------------------------------------------------------- reading


def test_read_into_out_tensors(tmp_path):
    tensors = odd_tensors()
    path, _ = save_with(tmp_path, "a", tensors)
    m = read_manifest(path)
    out = {k: torch.zeros_like(t) for k, t in tensors.items() if k != "noncontig"}
    out["noncontig"] = torch.zeros(tensors["noncontig"].shape[1], tensors["noncontig"].shape[0]).t()
    assert not out["noncontig"].is_contiguous()
    got = read_tensors(path, m, out=out)
    assert all(got[k] is out[k] for k in out)
    assert_same(tensors, got)
    with pytest.raises(LoadError, match="'bf16'"):
        read_tensors(path, m, ["bf16"], out={"bf16": torch.zeros(3, 1001)})
    with pytest.raises(LoadError, match="'bf16'"):
        read_tensors(path, m, ["bf16"], out={"bf16": torch.zeros(1001, 3, dtype=torch.bfloat16)})


def test_large_fresh_tensors_are_page_aligned(tmp_path):
    path, _ = save_with(tmp_path, "a", {"x": torch.randn(MiB)})
    got = read_tensors(path, read_manifest(path))["x"]
    assert got.data_ptr() % 4096 == 0
    got.add_(1)  # an ordinary, writable tensor


# ------------------------------------------------------------------- corruption


def test_flipped_byte_names_tensor(tmp_path):
    path = save(tmp_path, "a")
    m = read_manifest(path)
    e = m["tensors"]["i32"]
    flip_byte(os.path.join(path, "data.safetensors"), e["offset"] + 5)
    with pytest.raises(CorruptCheckpointError, match=r"data\.safetensors.*'i32'.*checksum"):
        read_tensors(path, m)
    # Other tensors are still readable, and verify=False skips the check.
    assert torch.equal(bits(read_tensors(path, m, ["f32"])["f32"]), bits(sample_tensors()["f32"]))
    assert read_tensors(path, m, ["i32"], verify=False)["i32"].shape == (8,)


@pytest.mark.parametrize("direct", [True, False])
def test_flipped_byte_in_later_chunk_names_tensor_and_chunk(tmp_path, direct):
    tensors = {"small": torch.ones(10), "big": torch.randn(3 * MiB)}  # 12 MiB: chunks 0, 1, 2
    path, _ = save_with(tmp_path, "a", tensors)
    m = read_manifest(path)
    e = m["tensors"]["big"]
    fpath = os.path.join(path, storage.DATA_FILE)
    pos = e["offset"] + 2 * 4 * MiB + 2 * MiB + 123  # middle of chunk 2 (the message says "block 2")
    with open(fpath, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError) as exc:
        read_tensors(path, m, direct=direct)
    msg = str(exc.value)
    assert path in msg and "data.safetensors" in msg and "'big'" in msg and "block 2" in msg
    assert "checksum mismatch" in msg
    assert read_tensors(path, m, ["small"])["small"].tolist() == [1.0] * 10
    got = read_tensors(path, m, ["big"], verify=False)["big"]
    assert (got != tensors["big"]).sum() == 1


def test_truncated_file(tmp_path):
    path = save(tmp_path, "a")
    data = os.path.join(path, "data.safetensors")
    m = read_manifest(path)
    last = max(m["tensors"], key=lambda k: m["tensors"][k]["offset"] + m["tensors"][k]["nbytes"])
    e = m["tensors"][last]
    os.truncate(data, e["offset"] + e["nbytes"] - 3)  # into the last tensor, not just its padding
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_manifest(path)
    # read_tensors checks too, even with a manifest read before the damage.
    with pytest.raises(CorruptCheckpointError, match=f"'{last}'.*truncated"):
        read_tensors(path, m)


def test_missing_file(tmp_path):
    path = save(tmp_path, "a")
    m = read_manifest(path)
    os.remove(os.path.join(path, "data.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="data.safetensors"):
        read_manifest(path)
    with pytest.raises(CorruptCheckpointError, match="data.safetensors"):
        read_tensors(path, m)
