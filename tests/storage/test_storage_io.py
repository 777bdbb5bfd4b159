"""Tests of gockpt.storage.io and the C++ I/O under it (csrc/crc32c, writer, reader): crc32c,
the named results, O_DIRECT and buffered paths, thread counts, writer lifetime."""

import errno
import os

import pytest
import torch

from gockpt import _C, storage
from gockpt.storage import (
    CheckpointWriter,
    read_manifest,
    read_tensors,
)
from gockpt.storage import io as _io
from tests._support.storage_helpers import (
    MiB, assert_same, bits, data_bytes, odd_tensors, save_with)


# ----------------------------------------------------------------------- crc32c


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


# -------------------------------------------------------- C++ writer and reader


@pytest.mark.parametrize("direct", [True, False])
def test_roundtrip_odd_sizes(tmp_path, direct):
    tensors = odd_tensors()
    path, w = save_with(tmp_path, "a", tensors, direct=direct)
    assert w.used_direct is (direct and w.used_direct)  # False when buffered was asked for
    if not direct:
        assert w.used_direct is False
    m = read_manifest(path)
    assert m["format_version"] == storage.FORMAT_VERSION
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


def test_threads_and_direct_do_not_change_the_bytes(tmp_path):
    tensors = odd_tensors()
    ref, _ = save_with(tmp_path / "ref", "a", tensors, threads=1, direct=False)
    expected = data_bytes(ref)
    for threads, direct in ((1, True), (4, True), (3, False), (8, True)):
        p, _ = save_with(tmp_path / f"t{threads}{direct}", "a", tensors, threads=threads, direct=direct)
        assert data_bytes(p) == expected, (threads, direct)
        assert read_manifest(p)["tensors"] == read_manifest(ref)["tensors"]


def test_o_direct_used_here_and_env_forces_buffered(tmp_path, monkeypatch):
    _, w = save_with(tmp_path / "d", "a", {"x": torch.randn(3 * MiB)})
    if not w.used_direct:
        pytest.skip("this file system refuses O_DIRECT (the buffered fallback is what runs)")
    monkeypatch.setenv("GOCKPT_IO_DIRECT", "0")
    _, w = save_with(tmp_path / "b", "a", {"x": torch.randn(3 * MiB)})
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


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_read_thread_counts(tmp_path, threads):
    tensors = odd_tensors()
    path, _ = save_with(tmp_path, "a", tensors)
    assert_same(tensors, read_tensors(path, read_manifest(path), threads=threads))


def test_dropping_an_unfinished_writer_is_safe(tmp_path):
    import gc

    w = CheckpointWriter(str(tmp_path), "a")
    w.begin({f"t{i}": (torch.float32, (MiB,)) for i in range(8)})
    for i in range(8):
        w.write(f"t{i}", torch.randn(MiB))  # the only references to these tensors
    del w
    gc.collect()  # joins the writer threads before the tensors are freed (no crash)


# ----------------------------------------------------------------------------- named results


def test_writer_and_reader_results_are_named(tmp_path):
    path = str(tmp_path / "f")
    data = torch.arange(5000, dtype=torch.int32).view(torch.uint8)  # 20000 bytes: 5 chunks of 4096
    n = data.numel()
    w = _io.Writer(path, 4096 + 20480, b"\0" * 4096, [(4096, n)], chunk_bytes=4096, threads=2, direct=False)
    w.submit(0, data.data_ptr(), 0, n, owner=data)
    res = w.finish()
    w.close()
    assert isinstance(res, _C.FinishResult)
    assert (res.err, res.msg, res.bad_tensor) == (0, "", -1)
    expected = [_io.crc32c(data[k:k + 4096].numpy()) for k in range(0, n, 4096)]
    assert res.crcs == [expected]
    with pytest.raises(AttributeError):
        res.err = 1

    out = torch.zeros_like(data)
    damaged = list(expected)
    damaged[3] ^= 1
    got = _io.read_into(path, [(4096, n, out.data_ptr(), 4096, damaged)], threads=2, direct=False)
    assert isinstance(got, _C.ReadResult)
    assert (got.err, got.msg, got.bad_item, got.direct, got.truncated) == (0, "", -1, False, [])
    assert got.mismatches == [(0, 3, expected[3])]  # (item, chunk, crc32c found)
    assert torch.equal(out, data)

    big = torch.zeros(30000, dtype=torch.uint8)
    got = _io.read_into(path, [(4096, 30000, big.data_ptr(), 4096, [])], verify=False, direct=False)
    assert got.err == 0 and got.truncated == [(0, 4096 + 20480)]  # (item, file offset of the end)
    got = _io.read_into(str(tmp_path / "missing"), [], direct=False)
    assert got.err == errno.ENOENT and "cannot open" in got.msg


def test_finish_result_names_the_tensor_not_covered(tmp_path):
    data = torch.ones(3000, dtype=torch.uint8)
    w = _io.Writer(str(tmp_path / "f"), 8192, b"\0" * 4096, [(4096, 3000)], chunk_bytes=4096, threads=1,
                   direct=False)
    w.submit(0, data.data_ptr(), 0, 1000, owner=data)
    res = w.finish()
    w.close()
    assert (res.err, res.bad_tensor, res.bad_offset, res.msg) == (-1, 0, 1000, "not all bytes were written")


# ------------------------------------------------- the C++ reader's items, in overflow-safe arithmetic


def _file_of_chunks(tmp_path, n=20000):
    """A file: 4096 zero bytes, then ``n`` bytes of data (and their crc32c per 4096-byte chunk)."""
    path = str(tmp_path / "f")
    data = (torch.arange(n, dtype=torch.int64) * 7919 % 251).to(torch.uint8)
    with open(path, "wb") as f:
        f.write(bytes(4096) + data.numpy().tobytes())
    return path, data, [_io.crc32c(data[k:k + 4096].numpy()) for k in range(0, n, 4096)]


@pytest.mark.parametrize("direct", [True, False])
def test_reader_refuses_unsound_items_before_reading_any(tmp_path, direct):
    path, data, crcs = _file_of_chunks(tmp_path)
    n = data.numel()
    good = torch.zeros(n, dtype=torch.uint8)
    out = torch.zeros(n, dtype=torch.uint8)
    cases = {
        "chunk size 0": (4096, n, out.data_ptr(), 0, crcs),  # once skipped without a word
        "largest file offset": (2**64 - 4096, 8192, out.data_ptr(), 4096, crcs[:2]),  # wraps to 0
        "largest file offset ": (2**63 - 4096, 8192, out.data_ptr(), 4096, crcs[:2]),  # off_t < 0
        "wraps": (4096, n, 2**64 - 4096, 4096, crcs),
        "checksums for": (4096, n, out.data_ptr(), 4096, crcs[:-1]),
    }
    for what, bad in cases.items():
        got = _io.read_into(path, [(4096, n, good.data_ptr(), 4096, crcs), bad], direct=direct)
        assert (got.err, got.bad_item) == (errno.EINVAL, 1), what
        assert what.strip() in got.msg and path in got.msg, got.msg
        assert not good.any() and not out.any(), what  # nothing read, not even the sound item
    # Unverified, the checksum list is not needed.
    got = _io.read_into(path, [(4096, n, out.data_ptr(), 4096, [])], verify=False, direct=direct)
    assert got.err == 0 and torch.equal(out, data)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("chunk", [2**64 - 4096, 2**63, 8192 * 3, 4096])
def test_reader_chunk_arithmetic_does_not_overflow(tmp_path, direct, chunk):
    # A chunk size of 2**64 - 4096 made the old chunk count (nbytes + chunk - 1) / chunk wrap
    # to 0: nothing read, nothing checksummed, no error.
    path, data, _ = _file_of_chunks(tmp_path)
    n = data.numel()
    crcs = [_io.crc32c(data[k:k + chunk].numpy()) for k in range(0, n, chunk)]
    out = torch.zeros(n, dtype=torch.uint8)
    got = _io.read_into(path, [(4096, n, out.data_ptr(), chunk, crcs)], direct=direct)
    assert (got.err, got.mismatches, got.truncated) == (0, [], [])
    assert torch.equal(out, data)
    damaged = list(crcs)
    damaged[-1] ^= 1
    got = _io.read_into(path, [(4096, n, out.data_ptr(), chunk, damaged)], direct=direct)
    assert got.mismatches == [(0, len(crcs) - 1, crcs[-1])]


@pytest.mark.parametrize("direct, aligned", [(False, False), (True, False), (True, True)])
def test_checksums_fed_in_pieces_are_those_of_one_pass(tmp_path, direct, aligned):
    # Buffered reads, and O_DIRECT reads through the bounce buffer (a destination not aligned to
    # 4096), are checksummed in pieces of 256 KiB as they land: chunks smaller and larger than
    # a piece, and not dividing it, give the crc32c of one pass over each chunk.
    from gockpt.storage.reader import _empty_for_read

    n = 3 * MiB + 12345
    path = str(tmp_path / "g")
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    for chunk in (4096, 100 * 4096, 4 * MiB):
        crcs = [_io.crc32c(data[k:k + chunk].numpy()) for k in range(0, n, chunk)]
        out = _empty_for_read([n], torch.uint8, n) if aligned else torch.zeros(n + 1, dtype=torch.uint8)[1:]
        out.zero_()
        assert (out.data_ptr() % 4096 == 0) is aligned
        got = _io.read_into(path, [(0, n, out.data_ptr(), chunk, crcs)], direct=direct, threads=3)
        assert (got.err, got.mismatches) == (0, []) and torch.equal(out, data), chunk
        damaged = list(crcs)
        damaged[len(crcs) // 2] ^= 1
        got = _io.read_into(path, [(0, n, out.data_ptr(), chunk, damaged)], direct=direct, threads=3)
        assert got.mismatches == [(0, len(crcs) // 2, crcs[len(crcs) // 2])], chunk


@pytest.mark.parametrize("impl", ["avx512-vpclmulqdq", "sse4.2"])
def test_crc32c_paths_agree_at_every_length(impl):
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    data = data.numpy().tobytes()
    try:
        _C.force_crc32c_impl(impl)
    except RuntimeError:
        pytest.skip(f"this CPU has no {impl} path")
    try:
        got = [_io.crc32c(data[s:s + n], 0x1234567) for s in (0, 5) for n in
               list(range(0, 600)) + [1023, 1024, 1025, 4095, 4096, 4097, 4995]]
    finally:
        _C.force_crc32c_impl("software")
    try:
        want = [_io.crc32c(data[s:s + n], 0x1234567) for s in (0, 5) for n in
                list(range(0, 600)) + [1023, 1024, 1025, 4095, 4096, 4097, 4995]]
    finally:
        _C.force_crc32c_impl("auto")
    assert got == want
