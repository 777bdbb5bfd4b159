"""Bad input and background failures: a gockpt exception that says what to do, nothing
half-written visible, training tensors untouched."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.replay import adapters as replay

from tests._support import harness as H, worker_env


def make(tmp_path, **kw):
    H.seed_all(0)
    model, opt, sched = H.build()
    kw.setdefault("block_bytes", 512)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), scheduler=sched, **kw)
    return model, opt, sched, ck


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model, opt, _ = H.build()
    with pytest.raises(gockpt.StorageError, match="writable"):
        gockpt.Checkpointer(model, opt, str(blocker / "ckpts"))


def test_model_optimizer_mismatch(tmp_path):
    model, _, _ = H.build()
    other, opt, _ = H.build()
    with pytest.raises(gockpt.ConfigError, match="model/optimizer mismatch"):
        gockpt.Checkpointer(model, opt, str(tmp_path))


@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(overlap_steps=0), dict(interval=-1),
                                 dict(self_check=2.0), dict(on_busy="maybe")])
def test_bad_options(tmp_path, bad):
    model, opt, _ = H.build()
    with pytest.raises(gockpt.ConfigError):
        gockpt.Checkpointer(model, opt, str(tmp_path), **bad)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, maximize=True),
    lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01)),
])
def test_unreplayable_optimizer_is_refused_and_names_other_modes(tmp_path, make_opt):
    model = torch.nn.Linear(4, 4)
    opt = make_opt(model.parameters())
    with pytest.raises(gockpt.UnsupportedOptimizerError, match="sync, async, async-o"):
        gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o")
    # the modes without replay accept it
    gockpt.Checkpointer(model, opt, str(tmp_path), mode="async-o").close()


def test_sgd_in_async_o_mode_round_trips(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async-o", block_bytes=64)
    for step in range(6):
        loss = model(torch.ones(2, 8)).pow(2).sum()
        ck.backward_begin(); loss.backward(); ck.update_begin()
        opt.step(); opt.zero_grad()
        ck.save_checkpoint(step + 1, force=step == 2)
        if step == 2:
            ref = H.snapshot(model, opt, None)
    ck.close()
    model2 = torch.nn.Linear(8, 8)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    gockpt.load(str(tmp_path), model2, opt2)
    H.assert_same(ref, H.snapshot(model2, opt2, None))


def test_update_begin_twice(tmp_path):
    model, opt, sched, ck = make(tmp_path)
    ck.backward_begin()
    ck.update_begin()
    with pytest.raises(gockpt.HookOrderError, match="update_begin"):
        ck.update_begin()
    ck.close()


def test_save_checkpoint_twice_without_a_step(tmp_path):
    model, opt, sched, ck = make(tmp_path)
    H.train_steps(model, opt, sched, 0, 1, ck)
    with pytest.raises(gockpt.HookOrderError, match="save_checkpoint"):
        ck.save_checkpoint(1)
    ck.close()


def test_optimizer_step_without_update_begin_surfaces_at_next_hook(tmp_path):
    model, opt, sched, ck = make(tmp_path, mode="gockpt-o", overlap_steps=3)
    H.train_steps(model, opt, sched, 0, 2, ck, force={2})
    x, y = H.batch(2)
    ck.backward_begin()
    torch.nn.functional.cross_entropy(model(x, 2), y).backward()
    opt.step()  # forgot update_begin
    with pytest.raises(gockpt.HookOrderError, match="update_begin"):
        ck.update_begin()
    ck.close()
    assert storage.list_checkpoints(str(tmp_path)) == []


def test_missing_checkpoint(tmp_path):
    model, opt, sched = H.build()
    with pytest.raises(gockpt.CheckpointNotFoundError):
        gockpt.load(str(tmp_path / "nothing"), model, opt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(gockpt.CheckpointNotFoundError, match="no committed checkpoint"):
        gockpt.load(str(tmp_path / "empty"), model, opt)


def test_load_into_model_of_another_shape_touches_nothing(tmp_path):
    model, opt, sched, ck = make(tmp_path, mode="async")
    H.train_steps(model, opt, sched, 0, 3, ck, force={2})
    ck.close()
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    other.inp = torch.nn.Linear(16, 40)  # same name, other shape
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(gockpt.LoadError, match="inp.weight|model state does not match"):
        gockpt.load(str(tmp_path), other, None)
    H.assert_same(before, dict(other.state_dict()))


def test_extra_state_that_needs_pickle_is_refused(tmp_path):
    model, opt, sched, ck = make(tmp_path, mode="async")
    H.train_steps(model, opt, sched, 0, 1, ck)
    x, y = H.batch(1)
    ck.backward_begin()
    torch.nn.functional.cross_entropy(model(x, 1), y).backward()
    ck.update_begin()
    opt.step()
    with pytest.raises(gockpt.ConfigError, match="without pickle"):
        ck.save_checkpoint(2, extra_state={"fn": object()}, force=True)
    ck.close()
    assert storage.list_checkpoints(str(tmp_path)) == []


class DiskFull(storage.CheckpointWriter):
    """A storage plugin that fails like a full disk once armed, when the test opens ``gate``."""

    gate = None
    armed = False

    def finish(self):
        if not DiskFull.armed:
            return super().finish()
        assert DiskFull.gate.wait(60)
        self.abort()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_background_write_failure_surfaces_and_keeps_previous_latest(tmp_path, monkeypatch):
    monkeypatch.setattr(DiskFull, "armed", False)
    model, opt, sched, ck = make(tmp_path, mode="gockpt-o", overlap_steps=2,
                                 storage_writer=DiskFull)
    H.train_steps(model, opt, sched, 0, 5, ck, force={2})
    ck.wait()
    good = storage.resolve(str(tmp_path))
    monkeypatch.setattr(DiskFull, "armed", True)
    before = H.snapshot(model, opt, sched)
    handle = None

    def on_boundary(step, h):
        nonlocal handle
        handle = handle or h

    DiskFull.gate = threading.Event()
    H.train_steps(model, opt, sched, 5, 8, ck, force={6}, on_boundary=on_boundary)
    DiskFull.gate.set()
    with pytest.raises(gockpt.CheckpointFailedError, match="No space left"):
        handle.wait()  # surfaces at wait() ...
    handle = None
    DiskFull.gate = threading.Event()
    # 10, not 9: the saves at 2, 6, 10 keep their learned spacing ahead of the end of this
    # run (a window planned for 13 would wait for this write, which the gate holds)
    H.train_steps(model, opt, sched, 8, 11, ck, force={10}, on_boundary=on_boundary)
    DiskFull.gate.set()
    assert handle.progress.durable.wait(60)  # finished (failed) in the background
    with pytest.raises(gockpt.CheckpointFailedError, match="No space left"):
        H.train_steps(model, opt, sched, 11, 12, ck)  # ... or at the next hook, once
    ck.close()
    assert storage.resolve(str(tmp_path)) == good
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp")] == []
    m2, o2, s2 = H.build(seed=5)
    gockpt.load(str(tmp_path), m2, o2, scheduler=s2)
    assert before is not None


def test_self_check_catches_a_wrong_replay(tmp_path, monkeypatch):
    real = replay.AdamAdapter.apply

    def wrong(self, record, host, threads):
        real(self, record, host, threads)
        for block in record.blocks:
            host.param[block.slot][block.start] += 1e-3

    monkeypatch.setattr(replay.AdamAdapter, "apply", wrong)
    model, opt, sched, ck = make(tmp_path, mode="gockpt", overlap_steps=3, self_check=1.0)
    handles = []
    with pytest.raises(gockpt.CheckpointFailedError, match="self-check"):
        # surfaces at the next hook or at wait(), whichever comes first
        H.train_steps(model, opt, sched, 0, 8, ck, at={4},
                      on_boundary=lambda s, h: h and handles.append(h))
        handles[0].wait()
    ck.close()
    assert storage.list_checkpoints(str(tmp_path)) == []


def test_exception_in_loop_then_close_leaves_nothing_partial(tmp_path):
    import threading
    before = set(threading.enumerate())  # (an earlier test's S3 pool may live on: per process)
    model, opt, sched, ck = make(tmp_path, mode="gockpt-o", overlap_steps=4)
    with pytest.raises(ZeroDivisionError):
        with ck:
            H.train_steps(model, opt, sched, 0, 3, ck, at={4})  # its window started at 1
            1 / 0
    assert storage.list_checkpoints(str(tmp_path)) == []
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("gockpt-")]


def test_load_with_a_mismatched_optimizer_touches_nothing(tmp_path):
    model, opt, sched, ck = make(tmp_path, mode="async")
    H.train_steps(model, opt, sched, 0, 3, ck, force={2})
    ck.close()
    m2, _, _ = H.build(seed=3)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    one_group = torch.optim.AdamW(m2.parameters())
    with pytest.raises(gockpt.LoadError, match="groups"):
        gockpt.load(str(tmp_path), m2, one_group)
    H.assert_same(before, dict(m2.state_dict()))


def test_load_reads_parameters_straight_into_the_model(tmp_path):
    model, opt, sched, ck = make(tmp_path, mode="async")
    H.train_steps(model, opt, sched, 0, 2, ck, force={2})  # checkpoint of the last step
    ck.close()
    m2, o2, s2 = H.build(seed=3)
    ptrs = {n: p.data_ptr() for n, p in m2.named_parameters()}
    gockpt.load(str(tmp_path), m2, o2, scheduler=s2)
    assert {n: p.data_ptr() for n, p in m2.named_parameters()} == ptrs
    H.assert_same(dict(model.state_dict()), dict(m2.state_dict()))


def test_an_exception_out_of_the_loop_without_close_ends_the_process_cleanly(tmp_path):
    # No `with`, no close(): the interpreter's exit closes the Checkpointer before it stops
    # the daemon threads (stopped inside the C++ writer, a thread ended the process with
    # "terminate called without an active exception"); the checkpoint asked for is committed.
    import subprocess
    import sys
    script = tmp_path / "loop.py"
    script.write_text(f"""
import gockpt
from tests._support import harness as H
model, opt, sched = H.build()
ck = gockpt.Checkpointer(model, opt, {str(tmp_path / "ck")!r}, mode="gockpt-o",
                         overlap_steps=2, interval=3, scheduler=sched)
H.train_steps(model, opt, sched, 0, 4, ck)
raise RuntimeError("the loop failed")
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=worker_env())
    assert proc.returncode == 1 and "RuntimeError: the loop failed" in proc.stderr
    assert "terminate" not in proc.stderr, proc.stderr
    assert storage.list_checkpoints(str(tmp_path / "ck")) == [storage.checkpoint_name(3)]
