"""Tests of gockpt.storage.commit: atomic publish, ``latest``, resolve, listing, cleanup of
temporaries."""

import os

import pytest
import torch

from gockpt.core.errors import CheckpointNotFoundError, StorageError
from gockpt.storage import (
    CheckpointWriter,
    checkpoint_name,
    cleanup_temporaries,
    list_checkpoints,
    read_manifest,
    read_tensors,
    resolve,
)
from gockpt.storage.commit import read_latest
from tests._support.storage_helpers import save


# ---------------------------------------------------------------------- publish


def test_commit_updates_latest_and_leaves_no_tmp(tmp_path):
    p1 = save(tmp_path, checkpoint_name(1))
    assert read_latest(str(tmp_path))[0] == "step-000000001"
    p2 = save(tmp_path, checkpoint_name(2))
    assert read_latest(str(tmp_path))[0] == "step-000000002"
    assert resolve(str(tmp_path)) == p2
    assert resolve(str(tmp_path), "step-000000001") == p1
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000001", "step-000000002"]
    assert sorted(os.listdir(p2)) == ["data.safetensors", "manifest.json"]


def test_commit_without_latest(tmp_path):
    save(tmp_path, "a")
    save(tmp_path, "best", update_latest=False)
    assert read_latest(str(tmp_path))[0] == "a"


def test_commit_replaces_existing(tmp_path):
    save(tmp_path, "a", {"x": torch.zeros(2)}, {"v": 1})
    path = save(tmp_path, "a", {"x": torch.ones(3)}, {"v": 2})
    m = read_manifest(path)
    assert m["v"] == 2 and read_tensors(path, m)["x"].tolist() == [1, 1, 1]
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]


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


# ------------------------------------------------------------- resolve and list


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


def test_resolve_latest_tag(tmp_path):
    path = save(tmp_path, "a")
    assert resolve(str(tmp_path), "latest") == path


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


def test_list_checkpoints_ties_sort_by_name(tmp_path):
    for name in ("step-000000002", "best", "step-000000001"):
        save(tmp_path, name)
        os.utime(tmp_path / name / "manifest.json", ns=(10**9, 10**9))
    assert list_checkpoints(str(tmp_path)) == ["best", "step-000000001", "step-000000002"]


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


def test_check_step_name_refuses_bad_and_existing_names(tmp_path):
    from gockpt.core.errors import ConfigError
    from gockpt.storage.commit import check_step_name
    check_step_name(str(tmp_path), "global_step3")
    (tmp_path / "global_step3").mkdir()
    for bad, why in (("global_step3", "exists"), ("../x", "checkpoint name"),
                     ("latest", "checkpoint name"), (".hidden", "checkpoint name")):
        with pytest.raises(ConfigError, match=why):
            check_step_name(str(tmp_path), bad)


def test_check_step_name_replaces_only_a_checkpoint_beyond_latest(tmp_path):
    """A committed checkpoint of a later step than ``latest``'s may be saved again; ``latest``'s,
    an older one, a directory without a manifest, a link, a bad name (even one that reaches
    a committed checkpoint elsewhere), and anything while ``latest`` is missing may not."""
    from gockpt.core.errors import ConfigError
    from gockpt.storage.commit import check_step_name
    run = tmp_path / "run"
    save(run, "step-000000002", manifest={"step": 2})
    save(run, "step-000000004", manifest={"step": 4})
    save(run, "step-000000008", manifest={"step": 8}, update_latest=False)  # (killed before latest named it)
    check_step_name(str(run), "step-000000008")
    check_step_name(str(run), "step-000000012")
    (run / "step-000000010").mkdir()
    os.symlink(run / "step-000000008", run / "step-000000009")
    save(tmp_path, "other", manifest={"step": 9}, update_latest=False)
    for bad, why in (("step-000000004", "'latest' names 'step-000000004' \\(step 4\\)"),
                     ("step-000000002", "\\(step 2\\).*'latest' names"),
                     ("step-000000010", "not a committed checkpoint"),
                     ("step-000000009", "not a committed checkpoint"),
                     ("../other", "checkpoint name")):
        with pytest.raises(ConfigError, match=why):
            check_step_name(str(run), bad)
    os.remove(run / "latest")
    with pytest.raises(ConfigError, match="latest' is missing"):
        check_step_name(str(run), "step-000000008")
