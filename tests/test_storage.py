"""Tests of gockpt.storage: format, atomic commit, validation and failure handling."""

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from faulty_storage import failing_writer
from gockpt import storage
from gockpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from gockpt.storage import (
    CheckpointWriter,
    checkpoint_name,
    cleanup_temporaries,
    list_checkpoints,
    read_manifest,
    read_tensors,
    resolve,
)


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f64": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "i32": torch.arange(-4, 4, dtype=torch.int32),
        "i16": torch.arange(7, dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 7),
        "empty_i": torch.empty(3, 0, dtype=torch.int64),
        "noncontig": torch.arange(24.0).reshape(4, 6).t()[1:, ::2],
        "u32": torch.tensor([0, 1, 2**32 - 1], dtype=torch.int64).to(torch.uint32),
    }


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def save(root, name, tensors=None, manifest=None, **kw):
    w = CheckpointWriter(str(root), name)
    w.write_tensors(sample_tensors() if tensors is None else tensors)
    return w.commit({"step": 1} if manifest is None else manifest, **kw)


def assert_same(expected, got):
    assert list(got) == list(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert bits(got[k]) == bits(t), k


def test_checkpoint_name():
    assert checkpoint_name(120) == "step-000000120"
    assert checkpoint_name(0) < checkpoint_name(9) < checkpoint_name(10)
    with pytest.raises(ValueError):
        checkpoint_name(-1)


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
    assert bits(sub["bf16"]) == bits(tensors["bf16"])


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


def test_large_tensor_in_several_blocks(tmp_path, monkeypatch):
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


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_flipped_byte_names_tensor(tmp_path):
    path = save(tmp_path, "a")
    m = read_manifest(path)
    e = m["tensors"]["i32"]
    flip_byte(os.path.join(path, "data.safetensors"), e["offset"] + 5)
    with pytest.raises(CorruptCheckpointError, match=r"data\.safetensors.*'i32'.*checksum"):
        read_tensors(path, m)
    # Other tensors are still readable, and verify=False skips the check.
    assert bits(read_tensors(path, m, ["f32"])["f32"]) == bits(sample_tensors()["f32"])
    assert read_tensors(path, m, ["i32"], verify=False)["i32"].shape == (8,)


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


def test_commit_updates_latest_and_leaves_no_tmp(tmp_path):
    p1 = save(tmp_path, checkpoint_name(1))
    assert (tmp_path / "latest").read_text() == "step-000000001"
    p2 = save(tmp_path, checkpoint_name(2))
    assert (tmp_path / "latest").read_text() == "step-000000002"
    assert resolve(str(tmp_path)) == p2
    assert resolve(str(tmp_path), "step-000000001") == p1
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000001", "step-000000002"]
    assert sorted(os.listdir(p2)) == ["data.safetensors", "manifest.json"]


def test_commit_without_latest(tmp_path):
    save(tmp_path, "a")
    save(tmp_path, "best", update_latest=False)
    assert (tmp_path / "latest").read_text() == "a"


def test_commit_replaces_existing(tmp_path):
    save(tmp_path, "a", {"x": torch.zeros(2)}, {"v": 1})
    path = save(tmp_path, "a", {"x": torch.ones(3)}, {"v": 2})
    m = read_manifest(path)
    assert m["v"] == 2 and read_tensors(path, m)["x"].tolist() == [1, 1, 1]
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]


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


def test_failure_in_commit_rename_keeps_previous(tmp_path, monkeypatch):
    prev = save(tmp_path, "a", {"x": torch.zeros(1)})
    w = CheckpointWriter(str(tmp_path), "a")
    w.write_tensors({"x": torch.ones(1)})
    real_rename = os.rename

    def failing_rename(src, dst):
        if os.path.basename(src).startswith(".tmp-a-"):
            raise OSError(5, "Input/output error")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(StorageError, match="Input/output"):
        w.commit({})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
    assert read_tensors(prev, read_manifest(prev))["x"].tolist() == [0]


def test_write_from_thread(tmp_path):
    import threading

    w = CheckpointWriter(str(tmp_path), "a")
    result = {}
    th = threading.Thread(target=lambda: result.update(n=w.write_tensors(sample_tensors())))
    th.start()
    th.join()
    path = w.commit({})
    assert result["n"] == os.path.getsize(os.path.join(path, "data.safetensors"))


def test_resolve_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve(str(tmp_path / "missing"))
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        resolve(str(tmp_path))
    save(tmp_path, checkpoint_name(5))
    with pytest.raises(CheckpointNotFoundError, match="step-000000005") as exc:
        resolve(str(tmp_path), "step-000000004")  # the message lists what exists
    assert "step-000000004" in str(exc.value)
    with pytest.raises(CheckpointNotFoundError):
        resolve(str(tmp_path), "../etc")


def test_resolve_falls_back_when_latest_is_stale(tmp_path):
    save(tmp_path, "a")
    newest = save(tmp_path, "b", update_latest=False)
    (tmp_path / "latest").write_text("gone")
    with pytest.warns(RuntimeWarning, match="gone"):
        assert resolve(str(tmp_path)) == newest
    os.remove(tmp_path / "latest")
    with pytest.warns(RuntimeWarning, match="missing"):
        assert resolve(str(tmp_path)) == newest


def test_list_checkpoints_ignores_temporaries(tmp_path):
    assert list_checkpoints(str(tmp_path / "none")) == []
    for i, step in enumerate((3, 1, 2)):
        save(tmp_path, checkpoint_name(step))
        # Commit age is the manifest's mtime; set it so the test does not depend
        # on the file system's timestamp granularity.
        os.utime(tmp_path / checkpoint_name(step) / "manifest.json", ns=(10**9 * (i + 1),) * 2)
    w = CheckpointWriter(str(tmp_path), checkpoint_name(4))  # in progress
    w.write_tensors({"x": torch.ones(1)})
    os.mkdir(tmp_path / "not-a-checkpoint")
    assert list_checkpoints(str(tmp_path)) == [checkpoint_name(s) for s in (3, 1, 2)]  # commit order
    w.commit({})
    assert list_checkpoints(str(tmp_path))[-1] == checkpoint_name(4)


def test_cleanup_temporaries(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale_dir = tmp_path / f".tmp-step-000000007-{dead_pid}-deadbeef"
    stale_dir.mkdir()
    (stale_dir / "data.safetensors").write_bytes(b"x")
    stale_file = tmp_path / f".tmp-latest-{dead_pid}-0badf00d"
    stale_file.write_text("a")
    live = CheckpointWriter(str(tmp_path), "live")  # this process: must survive
    other = tmp_path / ".tmp-unrelated"  # not ours by pattern: left alone
    other.mkdir()
    removed = cleanup_temporaries(str(tmp_path))
    assert sorted(removed) == sorted([str(stale_dir), str(stale_file)])
    assert os.path.isdir(live.tmp_path) and other.is_dir()
    assert not stale_dir.exists() and not stale_file.exists()
    assert cleanup_temporaries(str(tmp_path)) == []
    assert cleanup_temporaries(str(tmp_path / "none")) == []


def test_conjugated_view_is_written_by_value(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    path = save(tmp_path, "a", {"conj": z.conj(), "neg": z.conj().imag})
    got = read_tensors(path, read_manifest(path))
    assert got["conj"].tolist() == [1 - 2j, 3 + 4j]
    assert got["neg"].tolist() == [-2.0, 4.0]


def test_resolve_latest_tag(tmp_path):
    path = save(tmp_path, "a")
    assert resolve(str(tmp_path), "latest") == path


def test_list_checkpoints_ties_sort_by_name(tmp_path):
    for name in ("step-000000002", "best", "step-000000001"):
        save(tmp_path, name)
        os.utime(tmp_path / name / "manifest.json", ns=(10**9, 10**9))
    assert list_checkpoints(str(tmp_path)) == ["best", "step-000000001", "step-000000002"]
