"""Faults during persistence: kill -9 at random instants, disk full, read-only file system,
permission denied. Each time the previous checkpoint stays latest and loads."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import time

import pytest

import gockpt
from gockpt import storage

from tests._support import harness as H, worker_env
from tests._support.forked import Forked, run_worker

WORKER = "crash_worker"  # a module of tests._support


@pytest.mark.slow
def test_kill_9_at_random_instants_never_exposes_a_partial_checkpoint(tmp_path):
    rng = random.Random(1234)
    env = worker_env()
    resumed_from = []
    for attempt in range(20):
        # a fresh process each time (forked from the session's server that imported torch
        # once), killed for real
        proc = Forked(WORKER, [str(tmp_path)], env, stream=True)
        first = proc.stdout.readline()
        assert first.startswith("resumed"), first + proc.stderr.read()
        resumed_from.append(int(first.split()[1]))
        # Let it train until it has started a checkpoint, then kill it at a random instant
        # among the next steps (most of its time goes to persisting).
        target = rng.randint(3, 8)
        for _ in range(target):
            line = proc.stdout.readline()
            assert line.startswith("step"), line + proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.3))  # the random instant of the kill, not a synchronisation
        proc.kill()
        proc.wait()
        assert proc.returncode == -9
    # every restart found a complete checkpoint (the worker asserts it) and progress was made
    assert resumed_from[0] == 0 and resumed_from[-1] > 0
    assert resumed_from == sorted(resumed_from)
    # the last state loads and verifies too
    final = run_worker(WORKER, tmp_path, "--check-only", env=env, timeout=120)
    assert final.returncode == 0 and final.stdout.startswith("resumed"), final.stderr


def train_with(tmp_path, steps, force, **kw):
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=2,
                             scheduler=sched, block_bytes=4096, **kw)
    return model, opt, sched, ck


def checkpoint_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


@pytest.fixture
def small_fs(tmp_path):
    """A size-limited tmpfs of the test's own (root can mount one here)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()

    def mount(size_bytes):
        size = max(4096, size_bytes // 4096 * 4096)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs here ({r.stderr.strip()}): run the suite as root")
        return mnt
    yield mount
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_surfaces_and_keeps_previous_latest(tmp_path, small_fs):
    # measure one checkpoint, then give a file system room for about one and a half
    model, opt, sched, ck = train_with(tmp_path / "probe", 4, {2})
    H.train_steps(model, opt, sched, 0, 4, ck, force={2})
    ck.close()
    size = checkpoint_bytes(storage.resolve(str(tmp_path / "probe")))
    fs = small_fs(int(size * 1.5) + 8192)

    model, opt, sched, ck = train_with(fs, 0, ())
    H.train_steps(model, opt, sched, 0, 4, ck, force={2})
    ck.wait()
    good = storage.resolve(str(fs))
    before = H.snapshot(model, opt, sched)
    with pytest.raises(gockpt.CheckpointFailedError, match="No space left"):
        H.train_steps(model, opt, sched, 4, 10, ck, force={5})
        ck.wait()
    # training went on untouched by the failure: the live state is what training made
    H.train_steps(model, opt, sched, 10, 11, ck)
    ck.close()
    assert storage.resolve(str(fs)) == good
    assert not [n for n in os.listdir(fs) if n.startswith(".tmp")]
    m2, o2, s2 = H.build(seed=9)
    assert gockpt.load(str(fs), m2, o2, scheduler=s2).step == 2  # the step forced
    assert before is not None


def test_read_only_file_system_surfaces(tmp_path, small_fs):
    fs = small_fs(64 << 20)
    model, opt, sched, ck = train_with(fs, 0, ())
    H.train_steps(model, opt, sched, 0, 4, ck, force={2})
    ck.wait()
    good = storage.resolve(str(fs))
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    with pytest.raises(gockpt.CheckpointFailedError, match="Read-only file system"):
        H.train_steps(model, opt, sched, 4, 10, ck, force={5})
        ck.wait()
    ck.close()
    assert storage.resolve(str(fs)) == good
    m2, o2, s2 = H.build(seed=9)
    assert gockpt.load(str(fs), m2, o2, scheduler=s2).step == 2  # the step forced


class PermissionDenied(storage.CheckpointWriter):
    """A storage plugin that, once armed, fails as a file system denying access would (root
    ignores file modes here, so the fault is injected)."""

    armed = False

    def begin(self, layout):
        if not PermissionDenied.armed:
            return super().begin(layout)
        self.abort()
        raise PermissionError(errno.EACCES, "Permission denied", self.tmp_path)


def test_permission_denied_surfaces(tmp_path, monkeypatch):
    monkeypatch.setattr(PermissionDenied, "armed", False)
    model, opt, sched, ck = train_with(tmp_path, 0, (), storage_writer=PermissionDenied)
    H.train_steps(model, opt, sched, 0, 4, ck, force={2})
    ck.wait()
    good = storage.resolve(str(tmp_path))
    monkeypatch.setattr(PermissionDenied, "armed", True)
    with pytest.raises(gockpt.CheckpointFailedError, match="Permission denied"):
        H.train_steps(model, opt, sched, 4, 10, ck, force={5})
        ck.wait()
    ck.close()
    assert storage.resolve(str(tmp_path)) == good
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]
