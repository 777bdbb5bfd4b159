"""Tests of gockpt.storage.reader and .manifest_file: manifest validation, reads into out
tensors, corruption and truncation named down to tensor and chunk."""

import json
import os

import pytest
import torch

from gockpt import storage
from gockpt.core.errors import CheckpointNotFoundError, CorruptCheckpointError, LoadError
from gockpt.storage import (
    read_manifest,
    read_tensors,
)
from gockpt.storage.reader import read_spans
from gockpt.storage.format import seal_manifest
from tests._support.manifests import write_sealed
from tests._support.storage_helpers import (
    MiB, assert_same, bits, flip_byte, odd_tensors, sample_tensors, save, save_with)


# --------------------------------------------------------------------- manifest


def test_missing_or_invalid_manifest(tmp_path):
    path = save(tmp_path, "a")
    mpath = os.path.join(path, "manifest.json")
    with open(mpath, "w") as f:
        f.write('{"format": "gockpt", ')
    with pytest.raises(CorruptCheckpointError, match="damaged: its bytes do not match its seal"):
        read_manifest(path)
    with open(mpath, "wb") as f:
        f.write(seal_manifest({"format": "gockpt", "format_version": 99, "tensors": {}})[:-1])
    with pytest.raises(CorruptCheckpointError, match="damaged"):  # truncated
        read_manifest(path)
    write_sealed(path, {"format": "gockpt", "format_version": 99, "tensors": {}})
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
    m["format_version"] = 2
    with open(mpath, "w") as f:
        json.dump(m, f)  # unsealed, as version 2 wrote them
    with pytest.raises(CorruptCheckpointError, match="format_version 2 was written by an older"):
        read_manifest(path)


def test_manifest_crc_list_length_must_match(tmp_path):
    path, _ = save_with(tmp_path, "a", {"big": torch.randn(3 * MiB)})
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["tensors"]["big"]["crc32c"].pop()
    write_sealed(mpath, m)
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
        ("offset", 10**12, "data.safetensors: truncated: "),
        ("nbytes", 2**62, "does not match shape"),
        ("shape", [2**20, 2**20], "does not match shape"),
        ("shape", [0, 2**62], "invalid shape"),
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
    if field == "shape" and value == [2**20, 2**20]:
        m["tensors"]["f32"]["nbytes"] = 2**40 * 4  # consistent with the shape, far beyond the file
        message = "data.safetensors: truncated: "
    write_sealed(mpath, m)

    # No allocation must be attempted from the bad numbers.
    def no_alloc(*a, **k):
        raise AssertionError("allocated a tensor from an invalid manifest")

    monkeypatch.setattr(storage.reader.torch, "empty", no_alloc)
    with pytest.raises(CorruptCheckpointError, match=message) as exc:
        read_manifest(path)
    assert "'f32'" in str(exc.value) and path in str(exc.value)
    # read_tensors given the bad manifest without validation must not allocate either.
    if field in ("offset", "nbytes") or (field == "shape" and value == [2**20, 2**20]):
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


# ------------------------------------------------------------------ element ranges


def test_spans_read_whole_verified_chunks_around_each_range_once(tmp_path):
    """read_spans widens each element range to whole 8 KiB checksum chunks and reads runs that
    overlap or touch once: a damaged chunk outside every run is never read, one inside is
    named with its number in the tensor."""
    big = torch.arange(20000, dtype=torch.float32)  # 80,000 bytes: chunks 0..9 of 8192
    path, _ = save_with(tmp_path, "a", {"big": big, "small": torch.ones(3)}, chunk_bytes=8192)
    m = read_manifest(path)
    spans = {"big": [(2100, 2200), (100, 2048), (19999, 20000), (5000, 5000)], "small": [(1, 2)]}
    got = read_spans(path, m, spans)
    # elements 100..2200 lie in chunks 0..1 (bytes 0..16384), 19999 in chunk 9 (72 KiB..end)
    assert [(lo, t.numel()) for lo, t in got["big"]] == [(0, 4096), (18432, 20000 - 18432)]
    assert all(torch.equal(t, big[lo:lo + t.numel()]) for lo, t in got["big"])
    assert [(lo, t.tolist()) for lo, t in got["small"]] == [(0, [1.0, 1.0, 1.0])]
    e = m["tensors"]["big"]
    flip_byte(os.path.join(path, storage.DATA_FILE), e["offset"] + 5 * 8192 + 17)  # chunk 5
    assert torch.equal(read_spans(path, m, spans)["big"][1][1], big[18432:])
    with pytest.raises(CorruptCheckpointError, match=r"'big': block 5 \(bytes 40960\.\.49152 of the"
                                                     r" tensor, file offset \d+\): checksum"):
        read_spans(path, m, {"big": [(10300, 10301)]})
    assert read_spans(path, m, {"big": [(10300, 10301)]}, verify=False)["big"][0][0] == 10240


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


# ------------------------------------------------------- numbers beyond the C++ reader's range


def _one_chunk_tensor(tmp_path):
    """A checkpoint of one tensor of 20,000 bytes (one 4 MiB chunk: one checksum) and it."""
    t = torch.arange(5000, dtype=torch.float32)
    return save(tmp_path, "a", {"w": t}), t


@pytest.mark.parametrize("chunk", [2**64 - 4096, 2**64, 2**70])
def test_huge_chunk_size_is_refused_naming_the_tensor(tmp_path, chunk):
    # 2**64 - 4096 fits the binding's uint64, and the C++ chunk count (nbytes + chunk - 1) /
    # chunk wrapped to 0: the tensor was neither read nor checksummed, its destination kept
    # its old values, no error. 2**64 and up raised a TypeError from the binding.
    path, _ = _one_chunk_tensor(tmp_path)
    m = read_manifest(path)
    m["tensors"]["w"]["block_bytes"] = chunk  # one chunk, one checksum: the manifest checks pass
    out = {"w": torch.full((5000,), 7.0)}
    with pytest.raises(CorruptCheckpointError, match=r"data.safetensors.*'w'.*block_bytes"):
        read_tensors(path, m, ["w"], out=out)
    assert (out["w"] == 7.0).all()  # refused before anything was read


@pytest.mark.parametrize("chunk", [2**64 - 4096, 2**64])
def test_unverified_read_ignores_the_manifests_chunk_size(tmp_path, chunk):
    # Without checksums the chunk is only the unit of work: the manifest's is not trusted
    # (2**64 - 4096 once left the tensor unread, silently).
    path, t = _one_chunk_tensor(tmp_path)
    m = read_manifest(path)
    m["tensors"]["w"]["block_bytes"] = chunk
    out = {"w": torch.full((5000,), 7.0)}
    read_tensors(path, m, ["w"], out=out, verify=False)
    assert torch.equal(out["w"], t)


def test_largest_chunk_size_the_reader_takes_is_read_and_verified(tmp_path):
    path, t = _one_chunk_tensor(tmp_path)
    m = read_manifest(path)
    m["tensors"]["w"]["block_bytes"] = 2**63 - 4096
    assert torch.equal(read_tensors(path, m, ["w"])["w"], t)
    m["tensors"]["w"]["crc32c"] = [m["tensors"]["w"]["crc32c"][0] ^ 1]
    with pytest.raises(CorruptCheckpointError, match="'w'.*checksum mismatch"):
        read_tensors(path, m, ["w"])


def test_offsets_near_2_63_are_refused_naming_the_tensor(tmp_path, monkeypatch):
    path = save(tmp_path, "a")
    m = read_manifest(path)
    for offset in (2**63 - 4096, 2**63, 2**64 - 4096, 2**64):
        m["tensors"]["f32"]["offset"] = offset
        with pytest.raises(CorruptCheckpointError, match="'f32'"):
            read_tensors(path, m, ["f32"])
    # Past a file size check that believed it (a file system reporting a huge size): the
    # reader's own bound, then the C++ reader's.
    from gockpt.storage import reader

    real_stat, huge = os.stat, os.stat_result((0o100644, 0, 0, 1, 0, 0, 2**66, 0, 0, 0))
    monkeypatch.setattr(reader.os, "stat", lambda p, *a, **k: huge if str(p).endswith(storage.DATA_FILE)
                        else real_stat(p, *a, **k))
    m["tensors"]["f32"]["offset"] = 2**63 - 16  # its 48 bytes end past 2**63
    with pytest.raises(CorruptCheckpointError, match="'f32'.*largest file offset"):
        read_tensors(path, m, ["f32"])
    m["tensors"]["f32"]["offset"] = 2**63 - 4096  # within off_t: the kernel refuses the read
    with pytest.raises(CorruptCheckpointError, match="'f32'.*at offset 9223372036854771712 failed"):
        read_tensors(path, m, ["f32"])


def test_a_number_the_binding_cannot_take_is_a_corrupt_checkpoint(tmp_path, monkeypatch):
    # Should a value get past the entry checks, the binding's TypeError names file and tensor.
    from gockpt.storage import reader

    path = save(tmp_path, "a")
    m = read_manifest(path)
    m["tensors"]["i32"]["block_bytes"] = 2**64
    monkeypatch.setattr(reader, "check_tensor_entry", lambda *a, **k: None)
    monkeypatch.setattr(reader, "_io_range_problem", lambda *a, **k: None)
    with pytest.raises(CorruptCheckpointError, match=r"data.safetensors.*'i32'.*out of the reader's range"):
        read_tensors(path, m, ["f32", "i32"])
