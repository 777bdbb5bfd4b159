"""Tests of gockpt.storage.writer (CheckpointWriter): one call and streaming writes, misuse, failures
and aborts."""

import os
import random
import threading

import pytest
import torch
from safetensors import safe_open

from tests._support.faulty_storage import failing_writer
from gockpt import storage
from gockpt.core.errors import StorageError
from gockpt.storage import (
    CheckpointWriter,
    checkpoint_name,
    list_checkpoints,
    read_manifest,
    read_tensors,
    resolve,
)
from tests._support.storage_helpers import (
    MiB, assert_same, bits, data_bytes, layout_of, odd_tensors, sample_tensors, save, save_with)


# --------------------------------------------------------------------- one call


def test_roundtrip(tmp_path):
    tensors = sample_tensors()
    path = save(tmp_path, "step-000000001", tensors, {"step": 1, "extra": {"a": [1, 2]}})
    assert path == os.path.join(str(tmp_path), "step-000000001")
    m = read_manifest(path)
    assert m["format"] == "gockpt" and m["format_version"] == storage.FORMAT_VERSION
    assert m["step"] == 1 and m["extra"] == {"a": [1, 2]}
    assert m["tensors"]["bf16"]["dtype"] == "BF16" and m["tensors"]["scalar"]["shape"] == []
    got = read_tensors(path, m)
    assert_same(tensors, got)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in got.values())
    # Reading a subset returns just those, in the order asked.
    sub = read_tensors(path, m, ["i8", "bf16"])
    assert list(sub) == ["i8", "bf16"]
    assert torch.equal(bits(sub["bf16"]), bits(tensors["bf16"]))


def test_large_tensor_in_several_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(storage.writer, "CHUNK_BYTES", 4096)
    tensors = {"big": torch.randn(100, 37), "nc": torch.randn(37, 100).t(), "bf": torch.randn(9999).bfloat16()}
    path = save(tmp_path, "a", tensors)
    m = read_manifest(path)
    assert m["tensors"]["big"]["block_bytes"] == 4096 and len(m["tensors"]["big"]["crc32c"]) == 4
    assert len(m["tensors"]["bf"]["crc32c"]) == 5
    assert_same(tensors, read_tensors(path, m))


def test_no_tensors(tmp_path):
    path = save(tmp_path, "a", {}, {"only": "metadata"})
    m = read_manifest(path)
    assert m["tensors"] == {} and read_tensors(path, m) == {}
    with safe_open(os.path.join(path, "data.safetensors"), "pt") as f:
        assert list(f.keys()) == []


def test_reserved_pad_names_rejected(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(TypeError, match="__pad__"):
        w.write_tensors({"__pad__/0": torch.ones(1)})


def test_bad_tensor_values(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(TypeError, match="'c'.*complex128"):
        w.write_tensors({"c": torch.ones(1, dtype=torch.complex128)})
    assert os.listdir(tmp_path) == []
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(TypeError, match="'n'"):
        w.write_tensors({"n": [1.0]})


def test_write_twice_is_an_error(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.write_tensors({"x": torch.ones(1)})
    with pytest.raises(StorageError, match="already"):
        w.write_tensors({"x": torch.ones(1)})
    path = w.commit({})  # the writer is still usable
    assert list(read_manifest(path)["tensors"]) == ["x"]


def test_write_from_thread(tmp_path):
    import threading

    w = CheckpointWriter(str(tmp_path), "a")
    result = {}
    th = threading.Thread(target=lambda: result.update(n=w.write_tensors(sample_tensors())))
    th.start()
    th.join()
    path = w.commit({})
    assert result["n"] == os.path.getsize(os.path.join(path, "data.safetensors"))


def test_conjugated_view_is_written_by_value(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    path = save(tmp_path, "a", {"conj": z.conj(), "neg": z.conj().imag})
    got = read_tensors(path, read_manifest(path))
    assert got["conj"].tolist() == [1 - 2j, 3 + 4j]
    assert got["neg"].tolist() == [-2.0, 4.0]


def test_commit_rejects_reserved_and_non_json(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.write_tensors({})
    with pytest.raises(ValueError, match="reserved"):
        w.commit({"tensors": {}})
    assert os.listdir(tmp_path) == []  # the failed commit aborted
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(TypeError, match="gockpt.storage.tree"):
        w.commit({"x": float("nan")})
    w = CheckpointWriter(str(tmp_path), "a")
    with pytest.raises(TypeError, match="gockpt.storage.tree"):
        w.commit({"x": object()})
    assert os.listdir(tmp_path) == []


# -------------------------------------------------------------------- streaming


def test_streaming_in_ranges_from_threads_equals_write_tensors(tmp_path):
    tensors = odd_tensors()
    ref, _ = save_with(tmp_path / "ref", "a", tensors)
    w = CheckpointWriter(str(tmp_path / "s"), "a", threads=3)
    w.begin(layout_of(tensors))
    # Cut every tensor into odd-sized flat element ranges (unaligned in file and to chunks),
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


# --------------------------------------------------------------------- failures


def test_write_failure_surfaces_as_storage_error(tmp_path, monkeypatch):
    w = failing_writer(0, 5)(str(tmp_path), "a")  # EIO on the first data write
    with pytest.raises(StorageError, match="Input/output error"):
        w.write_tensors({"x": torch.randn(2 * MiB)})
    assert os.listdir(tmp_path) == []


def test_failure_in_write_keeps_previous_latest(tmp_path, monkeypatch):
    prev = save(tmp_path, checkpoint_name(1))
    # a storage plugin whose third data pwrite fails: "disk full"
    w = failing_writer(2, 28)(str(tmp_path), checkpoint_name(2))
    with pytest.raises(StorageError, match="No space left") as exc:
        w.write_tensors(sample_tensors())
    monkeypatch.undo()
    assert checkpoint_name(2) in str(exc.value)
    with pytest.raises(StorageError):
        w.commit({})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000001"]
    assert resolve(str(tmp_path)) == prev
    assert list_checkpoints(str(tmp_path)) == ["step-000000001"]


def test_abort_while_writing(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.begin({f"t{i}": (torch.float32, (MiB,)) for i in range(8)})
    for i in range(8):
        w.write(f"t{i}", torch.randn(MiB))
    w.abort()  # stops the threads, drops queued writes, removes the directory
    assert os.listdir(tmp_path) == []


def test_abort_leaves_nothing(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.write_tensors(sample_tensors())
    w.abort()
    w.abort()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(StorageError):
        w.commit({})
    assert os.listdir(tmp_path) == []


def test_abort_after_commit_keeps_checkpoint(tmp_path):
    w = CheckpointWriter(str(tmp_path), "a")
    w.write_tensors({"x": torch.ones(1)})
    path = w.commit({})
    w.abort()
    assert read_manifest(path)["tensors"]["x"]["shape"] == [1]


def test_creates_missing_root(tmp_path):
    root = tmp_path / "deep" / "er"
    path = save(root, "a")
    assert os.path.isdir(path)


def test_unwritable_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="directory") as exc:
        CheckpointWriter(str(blocker / "ckpts"), "a")
    assert str(blocker) in str(exc.value)
    with pytest.raises(StorageError):
        CheckpointWriter(str(blocker), "a")


def test_read_only_root(tmp_path):
    import subprocess
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        # root ignores file modes: a read-only file system refuses root too
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
        undo = ["umount", "-l", str(ro)]
    else:
        ro.chmod(0o500)
        undo = ["chmod", "700", str(ro)]
    try:
        with pytest.raises(StorageError, match="write"):
            CheckpointWriter(str(ro), "a")
    finally:
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("name", ["", ".hidden", "latest", "a/b", "../a"])
def test_bad_name(tmp_path, name):
    with pytest.raises(ValueError):
        CheckpointWriter(str(tmp_path), name)
    assert os.listdir(tmp_path) == []
