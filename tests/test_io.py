"""Tests of the parallel checkpoint I/O (csrc/io.cpp via gockpt._io) and its use in gockpt.storage:
crc32c, aligned safetensors layout, O_DIRECT and buffered paths, streaming writes, parallel
verified reads."""

import json
import os
import random
import struct
import threading

import pytest
import torch
from safetensors import safe_open

from faulty_storage import failing_writer
from gockpt import _C, storage
from gockpt.storage import io as _io
from gockpt.errors import CorruptCheckpointError, LoadError, StorageError
from gockpt.storage import CheckpointWriter, read_manifest, read_tensors

MiB = 1 << 20


def odd_tensors():
    g = torch.Generator().manual_seed(1)

    def u8(n):
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    return {
        "one_byte": u8(1),
        "b4095": u8(4095),
        "b4096": u8(4096),
        "b4097": u8(4097),
        "b4MiB+1": u8(4 * MiB + 1),
        "f32_9MiB": torch.randn(9 * MiB // 4 + 3, generator=g),
        "bf16": torch.randn(3, 1001, generator=g).bfloat16(),
        "scalar": torch.tensor(-1.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "noncontig": torch.randn(300, 70, generator=g).t()[::2],
        "bool": torch.tensor([True, False] * 3000),
    }


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(expected, got):
    assert list(got) == list(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(bits(got[k]), bits(t)), k


def save(root, name, tensors, **kw):
    w = CheckpointWriter(str(root), name, **kw)
    w.write_tensors(tensors)
    path = w.commit({"k": 1})
    return path, w


def data_bytes(path):
    with open(os.path.join(path, storage.DATA_FILE), "rb") as f:
        return f.read()


# ----------------------------------------------------------------------------- crc32c


@pytest.mark.parametrize("impl", ["auto", "software"])
def test_crc32c_known_vectors(impl):
    _C.force_crc32c_impl(impl)
    try:
        assert _io.crc32c(b"123456789") == 0xE3069283
        assert _io.crc32c(b"") == 0
        assert _io.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
        assert _io.crc32c(b"\xff" * 32) == 0x62A8AB43
        data = bytes(range(256)) * 50 + b"xyz"
        whole = _io.crc32c(data)
        for cut in (0, 1, 7, 4096, len(data)):
            a, b = data[:cut], data[cut:]
            assert _io.crc32c(b, _io.crc32c(a)) == whole  # continuation
            assert _io.crc32c_combine(_io.crc32c(a), _io.crc32c(b), len(b)) == whole
    finally:
        _C.force_crc32c_impl("auto")


def test_crc32c_hw_equals_sw_on_unaligned_input():
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8).numpy().tobytes()
    for start in range(9):
        hw = _io.crc32c(data[start:])
        _C.force_crc32c_impl("software")
        try:
            assert _io.crc32c(data[start:]) == hw
        finally:
            _C.force_crc32c_impl("auto")


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("direct", [True, False])
def test_roundtrip_odd_sizes(tmp_path, direct):
    tensors = odd_tensors()
    path, w = save(tmp_path, "a", tensors, direct=direct)
    assert w.used_direct is (direct and w.used_direct)  # False when buffered was asked for
    if not direct:
        assert w.used_direct is False
    m = read_manifest(path)
    assert m["format_version"] == 2
    for name, t in tensors.items():
        e = m["tensors"][name]
        assert e["offset"] % 4096 == 0, name
        assert e["block_bytes"] == storage.CHUNK_BYTES
        assert len(e["crc32c"]) == -(-e["nbytes"] // e["block_bytes"])
    assert m["tensors"]["b4MiB+1"]["crc32c"][1] == _io.crc32c(bits(tensors["b4MiB+1"])[4 * MiB:].numpy())
    assert m["tensors"]["empty"]["crc32c"] == []
    assert os.path.getsize(os.path.join(path, storage.DATA_FILE)) % 4096 == 0
    for rdirect in (True, False):
        assert_same(tensors, read_tensors(path, m, direct=rdirect))


def test_safetensors_reads_every_real_tensor(tmp_path):
    tensors = odd_tensors()
    path, _ = save(tmp_path, "a", tensors)
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


def test_reserved_pad_names_rejected(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(TypeError, match="__pad__"):
        w.write_tensors({"__pad__/0": torch.ones(1)})


def test_threads_and_direct_do_not_change_the_bytes(tmp_path):
    tensors = odd_tensors()
    ref, _ = save(tmp_path / "ref", "a", tensors, threads=1, direct=False)
    expected = data_bytes(ref)
    for threads, direct in ((1, True), (4, True), (3, False), (8, True)):
        p, _ = save(tmp_path / f"t{threads}{direct}", "a", tensors, threads=threads, direct=direct)
        assert data_bytes(p) == expected, (threads, direct)
        assert read_manifest(p)["tensors"] == read_manifest(ref)["tensors"]


def test_o_direct_used_here_and_env_forces_buffered(tmp_path, monkeypatch):
    _, w = save(tmp_path / "d", "a", {"x": torch.randn(3 * MiB)})
    if not w.used_direct:
        pytest.skip("this file system refuses O_DIRECT (the buffered fallback is what runs)")
    monkeypatch.setenv("GOCKPT_IO_DIRECT", "0")
    _, w = save(tmp_path / "b", "a", {"x": torch.randn(3 * MiB)})
    assert w.used_direct is False


def test_fallback_is_logged_once(tmp_path, monkeypatch, caplog):
    # Pretend O_DIRECT was refused: the C++ writer reports fallback_reason, Python logs once.
    monkeypatch.setattr(_io, "_said_fallback", False)
    calls = []

    class Fake:
        direct = False
        threads = 1
        fallback_reason = "O_DIRECT refused at open: Invalid argument"

        def __init__(self, *a):
            calls.append(a)

        def close(self):
            pass

    monkeypatch.setattr(_C, "IoWriter", Fake)
    with caplog.at_level("DEBUG", logger="gockpt"):
        _io.Writer(str(tmp_path / "x"), 4096, b"", [], chunk_bytes=4096, direct=True)
        _io.Writer(str(tmp_path / "y"), 4096, b"", [], chunk_bytes=4096, direct=True)
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and "buffered" in warnings[0].getMessage()


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("direct", [True, False])
def test_flipped_byte_in_later_block_names_tensor_and_block(tmp_path, direct):
    tensors = {"small": torch.ones(10), "big": torch.randn(3 * MiB)}  # 12 MiB: blocks 0, 1, 2
    path, _ = save(tmp_path, "a", tensors)
    m = read_manifest(path)
    e = m["tensors"]["big"]
    fpath = os.path.join(path, storage.DATA_FILE)
    pos = e["offset"] + 2 * 4 * MiB + 2 * MiB + 123  # middle of block 2
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


def test_manifest_crc_list_length_must_match(tmp_path):
    path, _ = save(tmp_path, "a", {"big": torch.randn(3 * MiB)})
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


def test_old_format_version_refused(tmp_path):
    path, _ = save(tmp_path, "a", {"x": torch.ones(1)})
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["format_version"] = 1
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(CorruptCheckpointError, match="format_version 1"):
        read_manifest(path)


# ----------------------------------------------------------------------------- streaming


def layout_of(tensors):
    return {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}


def test_streaming_in_ranges_from_threads_equals_write_tensors(tmp_path):
    tensors = odd_tensors()
    ref, _ = save(tmp_path / "ref", "a", tensors)
    w = CheckpointWriter(str(tmp_path / "s"), "a", threads=3)
    w.begin(layout_of(tensors))
    # Cut every tensor into odd-sized flat element ranges (unaligned in file and to blocks),
    # then write them in random order from several threads.
    pieces = []
    rng = random.Random(0)
    for name, t in tensors.items():
        flat = t.contiguous().reshape(-1)
        pos = 0
        while pos < flat.numel():
            n = min(flat.numel() - pos, rng.choice([1, 3, 1000, 4097, 700_001, 2 * MiB + 5]))
            pieces.append((name, flat[pos:pos + n], pos))
            pos += n
        if flat.numel() == 0:
            pieces.append((name, t, 0))
    rng.shuffle(pieces)

    def run(part):
        for name, piece, start in part:
            w.write(name, piece, start=start)

    ths = [threading.Thread(target=run, args=(pieces[i::4],)) for i in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    size = w.finish()
    path = w.commit({"k": 1})
    assert size == os.path.getsize(os.path.join(path, storage.DATA_FILE))
    assert data_bytes(path) == data_bytes(ref)
    assert read_manifest(path)["tensors"] == read_manifest(ref)["tensors"]  # combined crcs agree
    assert_same(tensors, read_tensors(path, read_manifest(path)))


def test_streaming_whole_tensors_then_commit_finishes(tmp_path):
    tensors = {"a": torch.randn(5, 7), "b": torch.arange(10)}
    w = CheckpointWriter(str(tmp_path), "a")
    w.begin(layout_of(tensors))
    w.write("b", tensors["b"])
    w.write("a", tensors["a"])
    path = w.commit({})  # finish() implied
    assert_same(tensors, read_tensors(path, read_manifest(path)))


def test_streaming_incomplete_or_overlapping_is_an_error(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.begin({"x": (torch.float32, (5000,))})
    w.write("x", torch.ones(4000))
    with pytest.raises(StorageError, match="'x'.*not all bytes"):
        w.finish()
    assert os.listdir(tmp_path) == []  # aborted
    w = CheckpointWriter(str(tmp_path), "a")
    w.begin({"x": (torch.float32, (5000,))})
    w.write("x", torch.ones(5000))
    w.write("x", torch.ones(10), start=100)
    with pytest.raises(StorageError, match="'x'.*more than once"):
        w.finish()
    assert os.listdir(tmp_path) == []


def test_streaming_misuse(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(StorageError, match="begin"):
        w.write("x", torch.ones(1))
    w.begin({"x": (torch.float32, (2, 3))})
    with pytest.raises(ValueError, match="not in the layout"):
        w.write("y", torch.ones(1))
    with pytest.raises(TypeError, match="dtype"):
        w.write("x", torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="outside"):
        w.write("x", torch.ones(4), start=3)
    with pytest.raises(ValueError, match="shape"):
        w.write("x", torch.ones(3, 2))
    with pytest.raises(StorageError, match="already"):
        w.begin({})
    w.write("x", torch.ones(2, 3))
    w.finish()
    w.abort()
    assert os.listdir(tmp_path) == []


def test_write_failure_surfaces_as_storage_error(tmp_path, monkeypatch):
    w = failing_writer(0, 5)(str(tmp_path), "a")  # EIO on the first data write
    with pytest.raises(StorageError, match="Input/output error"):
        w.write_tensors({"x": torch.randn(2 * MiB)})
    assert os.listdir(tmp_path) == []


def test_dropping_an_unfinished_writer_is_safe(tmp_path):
    import gc

    w = CheckpointWriter(str(tmp_path), "a")
    w.begin({f"t{i}": (torch.float32, (MiB,)) for i in range(8)})
    for i in range(8):
        w.write(f"t{i}", torch.randn(MiB))  # the only references to these tensors
    del w
    gc.collect()  # joins the writer threads before the tensors are freed (no crash)


def test_abort_while_writing(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.begin({f"t{i}": (torch.float32, (MiB,)) for i in range(8)})
    for i in range(8):
        w.write(f"t{i}", torch.randn(MiB))
    w.abort()  # stops the threads, drops queued writes, removes the directory
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- reading


def test_read_into_out_tensors(tmp_path):
    tensors = odd_tensors()
    path, _ = save(tmp_path, "a", tensors)
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


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_read_thread_counts(tmp_path, threads):
    tensors = odd_tensors()
    path, _ = save(tmp_path, "a", tensors)
    assert_same(tensors, read_tensors(path, read_manifest(path), threads=threads))


def test_large_fresh_tensors_are_page_aligned(tmp_path):
    path, _ = save(tmp_path, "a", {"x": torch.randn(MiB)})
    got = read_tensors(path, read_manifest(path))["x"]
    assert got.data_ptr() % 4096 == 0
    got.add_(1)  # an ordinary, writable tensor
