"""gockpt.storage.lock: one writer per checkpoint directory, named when refused, released on
close or death."""

from __future__ import annotations

import os

import pytest

from gockpt.core.errors import DirectoryInUseError, StorageError
from gockpt.storage.lock import LOCK_FILE, DirectoryLock


def test_a_second_lock_is_refused_naming_the_holder_until_released(tmp_path):
    first = DirectoryLock(str(tmp_path))
    assert first.held and os.path.exists(tmp_path / LOCK_FILE)
    with pytest.raises(DirectoryInUseError, match=f"pid {os.getpid()} on host .*, since"):
        DirectoryLock(str(tmp_path))
    first.release()
    first.release()  # idempotent
    assert not first.held
    second = DirectoryLock(str(tmp_path))  # the file stays; the lock is free again
    second.release()


def test_an_unreadable_holder_is_still_refused(tmp_path):
    first = DirectoryLock(str(tmp_path))
    (tmp_path / LOCK_FILE).write_text("not json")
    with pytest.raises(DirectoryInUseError, match="holder unknown"):
        DirectoryLock(str(tmp_path))
    first.release()


def test_a_directory_that_cannot_hold_the_lock_file_is_a_storage_error(tmp_path):
    with pytest.raises(StorageError, match="cannot create the lock file"):
        DirectoryLock(str(tmp_path / "missing"))


def test_the_shared_lock_of_other_ranks_holds_nothing():
    shared = DirectoryLock.shared()
    assert not shared.held
    shared.release()


# ------------------------------------------------------------------ a dead writer never blocks

WITH_WORKERS = r"""
import signal, sys, torch, gockpt
from torch.utils.data import DataLoader, TensorDataset
model = torch.nn.Linear(2, 2)
ck = gockpt.Checkpointer(model, torch.optim.AdamW(model.parameters()), sys.argv[1], mode="sync")
loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4, num_workers=2,
                    persistent_workers=True)
it = iter(loader)
next(it)
print(" ".join(str(w.pid) for w in it._workers), flush=True)
signal.pause()   # hold the lock until killed
"""


def test_a_restart_right_after_kill_9_with_dataloader_workers_succeeds(tmp_path):
    """The DataLoader workers forked by the killed process outlive it (here: stopped, so that
    they certainly do); they must not hold the directory's lock."""
    import signal
    import gockpt
    import torch
    from tests._support import worker_env
    from tests._support.forked import Forked
    run = str(tmp_path / "run")
    script = tmp_path / "holder.py"
    script.write_text(WITH_WORKERS)
    # its own process (forked from the tests' server that imported torch once), killed for real
    holder = Forked(str(script), [run], worker_env(), stream=True)
    workers = [int(p) for p in holder.stdout.readline().split()]
    try:
        assert len(workers) == 2, holder.stderr.read()
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        holder.kill()
        assert holder.returncode == -9
        model = torch.nn.Linear(2, 2)
        gockpt.Checkpointer(model, torch.optim.AdamW(model.parameters()), run,
                            mode="sync").close()
    finally:
        holder.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


HOLD_FILE = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def other_holder(tmp_path):
    """Another process holding the flock of the lock file (as an orphan that inherited it, or
    a file server still holding a dead host's lock); yields a function writing the record."""
    import json
    import subprocess
    import sys
    path = tmp_path / LOCK_FILE
    path.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", HOLD_FILE, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"

    def record(mtime=None, **info):
        path.write_text(json.dumps(dict({"since": 1.7e9}, **info)))
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return proc.pid

    yield record
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_lock_of_a_dead_pid_on_this_host_is_taken_over_with_a_note(tmp_path, other_holder):
    import socket
    dead = _dead_pid()
    other_holder(pid=dead, host=socket.gethostname())
    with pytest.warns(UserWarning, match=f"took over the lock .* pid {dead} is not running"):
        lock = DirectoryLock(str(tmp_path))
    assert lock.held
    with pytest.raises(DirectoryInUseError, match=f"pid {os.getpid()} on host"):
        DirectoryLock(str(tmp_path))  # the new lock is the one that counts
    lock.release()


def test_a_reused_pid_is_not_the_dead_holder(tmp_path, other_holder):
    import socket
    pid = other_holder(host=socket.gethostname(), pid=os.getpid(), start="1")  # not our start
    with pytest.warns(UserWarning, match=f"pid {os.getpid()} is now another process"):
        DirectoryLock(str(tmp_path)).release()
    assert pid != os.getpid()


def test_a_live_holder_on_this_host_is_never_taken_over(tmp_path, other_holder):
    import socket
    pid = other_holder(host=socket.gethostname())
    other_holder(pid=pid, host=socket.gethostname())
    with pytest.raises(DirectoryInUseError, match=f"pid {pid} on host"):
        DirectoryLock(str(tmp_path))


def test_a_holder_on_another_host_is_taken_over_only_when_its_heartbeat_stopped(tmp_path,
                                                                                other_holder):
    import time
    from gockpt.storage import lock as lock_mod
    other_holder(pid=4242, host="node-7", mtime=time.time())  # beating
    with pytest.raises(DirectoryInUseError, match="pid 4242 on host node-7"):
        DirectoryLock(str(tmp_path))
    other_holder(pid=4242, host="node-7", mtime=time.time() - 10 * lock_mod.LEASE_S)
    with pytest.warns(UserWarning, match="from a dead writer .*node-7.*no heartbeat"):
        lock = DirectoryLock(str(tmp_path))
    assert lock.held
    lock.release()


def test_the_holder_beats_its_heartbeat(tmp_path, monkeypatch):
    """The heartbeat thread refreshes the lock file's mtime (driven here without waiting)."""
    from gockpt.storage import lock as lock_mod
    beats = []
    monkeypatch.setattr(lock_mod.os, "utime", lambda path: beats.append(path))
    ticks = iter([False, False, True])
    lock = DirectoryLock(str(tmp_path))
    lock._stop.wait = lambda timeout: next(ticks)  # two beats, then released
    lock._beat()
    assert beats == [lock.path, lock.path]
    lock.release()
