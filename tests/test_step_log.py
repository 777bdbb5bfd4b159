"""The memory tier's step log (Config.memory_log): a process killed between checkpoints restarts
at its last logged step, bit for bit the uninterrupted run's state there (model, optimizer,
scheduler, RNG, extra_state); a damaged entry ends the replay before it; a replay that does
not match its digests loads the checkpoint again; a second crash before the next checkpoint
replays the first process's steps and the second's."""

import os
import random
import re
import tempfile

import numpy as np
import pytest
import torch

import gockpt
from gockpt.core.errors import ConfigError
from gockpt.storage import memory_tier
from gockpt.storage.steplog import log_root
from gockpt.testing import assert_same, snapshot
from tests._support import worker_env
from tests._support.cli_helpers import flip_byte
from tests._support.forked import run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVERY = 5  # a checkpoint every 5 steps


@pytest.fixture
def shm():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="gockpt-test-log-", dir=base) as d:
        yield d


def _objects(optim=torch.optim.AdamW):
    torch.manual_seed(0)  # (and every RNG a checkpoint holds: the states are compared)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 4))  # (dropout: the RNG matters)
    opt = optim(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _steps(model, opt, sched, ck, first, last, snaps=None, bf16=False, clip_at=None):
    """Train steps ``first``..``last`` (the data depends on the step only); ``bf16``: under
    bf16 autocast; ``clip_at``: that step's gradients clipped."""
    for step in range(first, last + 1):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x).float().square().mean()
        if ck is not None:
            ck.backward_begin()
        loss.backward()
        if step == clip_at:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        if ck is not None:
            ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        if ck is not None:
            ck.save_checkpoint(step, extra_state={"seen": step})
        if snaps is not None:
            snaps[step] = _state(model, opt, sched)


def _state(model, opt, sched):
    return {"state": snapshot(model, opt), "sched": sched.state_dict(),
            "rng": torch.get_rng_state()}


def _reference(last):
    """The uninterrupted run's state after every step (no gockpt)."""
    snaps = {}
    _steps(*_objects(), None, 1, last, snaps)
    return snaps


def _checkpointer(run, shm, model, opt, sched, **options):
    return gockpt.Checkpointer(model, opt, run, mode="gockpt-o", overlap_steps=2,
                               interval=EVERY, scheduler=sched, memory="auto", memory_dir=shm,
                               memory_log=1 << 26, **options)


def _killed_after(run, shm, step, first=1):
    """A process (its own, forked) that trains (resuming from ``run`` when ``first`` > 1; else up to step 6,
    waiting for the checkpoint of step 5) up to ``step``'s boundary and is killed with
    SIGKILL right after it (its log thread mid-write)."""
    code = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
import gockpt
from tests.test_step_log import _objects, _steps, _checkpointer
model, opt, sched = _objects()
first = {first}
if first > 1:
    assert gockpt.load({run!r}, model, opt, scheduler=sched, memory_dir={shm!r}).step == first - 1
ck = _checkpointer({run!r}, {shm!r}, model, opt, sched)
if first == 1:  # (the checkpoint of step 5 committed: a restart has a base)
    _steps(model, opt, sched, ck, 1, 6)
    ck.wait()
    first = 7
_steps(model, opt, sched, ck, first, {step})
os.kill(os.getpid(), signal.SIGKILL)
"""
    script = os.path.join(os.path.dirname(run), "killed.py")
    with open(script, "w") as f:
        f.write(code)
    # (forked from the tests' server that imported torch once: tests/_support/forked.py)
    proc = run_worker(script, env=worker_env(), timeout=120)
    assert proc.returncode == -9, proc.stderr


def _restart(run, shm, optim=torch.optim.AdamW):
    model, opt, sched = _objects(optim)
    restored = gockpt.load(run, model, opt, scheduler=sched, memory_dir=shm)
    return restored, _state(model, opt, sched)


@pytest.mark.parametrize("killed_at", [7, 9, 11])
def test_a_killed_process_restarts_at_its_last_step_not_at_the_checkpoint(tmp_path, shm,
                                                                         killed_at):
    """Killed right after the boundary of a step inside a checkpoint's window (7, 9: K=2
    windows end at 10) or after one (11): the restart resumes at that step or the one
    before (whose entry a boundary waits for), bitwise, and training on from there gives
    the uninterrupted run's states."""
    run = str(tmp_path / "run")
    reference = _reference(14)
    _killed_after(run, shm, killed_at)
    restored, state = _restart(run, shm)
    assert killed_at - 1 <= restored.step <= killed_at, restored.step
    assert restored.extra_state == {"seen": restored.step}
    assert_same(state, reference[restored.step])
    # from the log's entry of that step; or (killed at 11 after the checkpoint of 10 was
    # committed and the log pruned up to it, before step 11's entry was whole: a matter of
    # timing, both correct) from that checkpoint itself, on disk or its memory copy
    entry = os.path.join(log_root(memory_tier.root_of(os.path.realpath(run), shm)),
                         f"step-{restored.step:09d}")
    assert restored.path == entry or (
        restored.step == 10 and os.path.basename(restored.path) == "step-000000010"
        and os.path.dirname(restored.path) != os.path.dirname(entry)), restored.path
    model, opt, sched = _objects()
    gockpt.load(run, model, opt, scheduler=sched, memory_dir=shm)
    _steps(model, opt, sched, None, restored.step + 1, 14)
    assert_same(_state(model, opt, sched), reference[14])


def test_a_second_crash_before_the_next_checkpoint_replays_both_processes_steps(tmp_path, shm):
    run = str(tmp_path / "run")
    reference = _reference(9)
    _killed_after(run, shm, 7)
    first, _ = _restart(run, shm)
    _killed_after(run, shm, 9, first=first.step + 1)
    restored, state = _restart(run, shm)
    assert restored.step >= 8
    assert_same(state, reference[restored.step])


def test_a_damaged_entry_ends_the_replay_before_it(tmp_path, shm):
    run = str(tmp_path / "run")
    reference = _reference(9)
    _killed_after(run, shm, 9)
    log = log_root(memory_tier.root_of(os.path.realpath(run), shm))
    flip_byte(os.path.join(log, "step-000000008"), "grad/0.weight")
    with pytest.warns(RuntimeWarning, match=r"entry .*step-000000008 is damaged .*the replay "
                                            r"stops before it"):
        restored, state = _restart(run, shm)
    assert restored.step == 7
    assert_same(state, reference[7])


class AdamW(torch.optim.AdamW):
    """Another AdamW than the one the run trained with (as after an upgrade that changed
    its kernel): the last bit of every parameter it updates differs."""

    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.view(torch.int32).bitwise_xor_(1)
        return out


def test_a_replay_that_does_not_match_its_digests_loads_the_checkpoint(tmp_path, shm):
    """The restarted script's optimizer updates otherwise than the run's: the checkpoint
    loads, but the replayed steps differ from the logged digests."""
    run = str(tmp_path / "run")
    reference = _reference(8)
    _killed_after(run, shm, 8)
    with pytest.warns(RuntimeWarning, match=r"cannot be replayed \(.*differs from its logged "
                                            r"digests .*resuming at the checkpoint of step 5"):
        restored, state = _restart(run, shm, optim=AdamW)
    assert restored.step == 5
    assert_same(state["state"]["model"], reference[5]["state"]["model"])


def test_a_full_log_stops_until_the_next_checkpoint(tmp_path, shm):
    run = str(tmp_path / "run")
    model, opt, sched = _objects()
    ck = _checkpointer(run, shm, model, opt, sched)
    _steps(model, opt, sched, ck, 1, 6)
    ck.wait()  # (the checkpoint of step 5: the entries up to it are deleted)
    ck.steplog.writer.flush()
    ck.steplog.writer.limit = ck.steplog.writer._bytes * 5 // 2  # two entries and a half
    with pytest.warns(RuntimeWarning, match="the step log is full") as said:
        _steps(model, opt, sched, ck, 7, 9)  # (no checkpoint: 10 is the next)
        ck.steplog.writer.flush()
    full = int(re.search(r"at step (\d+)", str(said[0].message)).group(1))
    assert full in (8, 9)  # (two and a half entries fit)
    restored, _ = _restart(run, shm)
    assert restored.step == full - 1  # none after the log filled up
    ck.close()


def test_the_step_log_needs_the_memory_tier(tmp_path, shm):
    model, opt, _ = _objects()
    with pytest.raises(ConfigError, match="memory_log must be None or a number of bytes >= 1 "
                                          "with the memory tier on"):
        gockpt.Checkpointer(model, opt, str(tmp_path / "r"), memory_log=1 << 20)


def test_a_step_log_that_does_not_fit_in_the_memory_dir_is_refused(tmp_path, shm):
    # counted beside the copies when the Checkpointer is built (was: not counted: the log
    # filled the tmpfs the copies needed)
    model, opt, sched = _objects()
    free = memory_tier.free_bytes(shm)
    with pytest.raises(ConfigError, match=rf"the step log memory_log={free}; give "
                                          "memory_log less"):
        gockpt.Checkpointer(model, opt, str(tmp_path / "r"), memory="auto", memory_dir=shm,
                            memory_log=free)


def test_a_checkpoint_comes_before_the_log_is_full(tmp_path, shm):
    # an entry: the gradients (212 parameters, 848 bytes), no buffers, 64 KiB of the rest; a
    # log of 8 entries asks a checkpoint every 4 steps whatever the interval (100 here), so
    # it never fills (without it: entries 1..8, then none); one that holds fewer than 4 is
    # refused when the Checkpointer is built
    entry = 4 * 212 + (64 << 10)
    model, opt, sched = _objects()
    with pytest.raises(ConfigError, match="holds 3 step"):
        gockpt.Checkpointer(model, opt, str(tmp_path / "small"), memory="auto",
                            memory_dir=shm, memory_log=3 * entry + 1)
    run = str(tmp_path / "run")
    ck = gockpt.Checkpointer(model, opt, run, mode="gockpt-o", overlap_steps=2, interval=100,
                             scheduler=sched, memory="auto", memory_dir=shm,
                             memory_log=8 * entry + 1)
    _steps(model, opt, sched, ck, 1, 11)
    ck.wait()  # (the checkpoint of step 8 committed: the log pruned up to it)
    ck.steplog.writer.flush()
    assert [m["final_step"] for m in gockpt.metrics.read(run)] == [4, 8]
    log = log_root(memory_tier.root_of(os.path.realpath(run), shm))
    assert sorted(os.listdir(log)) == [f"step-{s:09d}" for s in (9, 10, 11)]
    ck.close()


def test_bf16_gradients_are_logged_in_bf16_and_replayed_bitwise(tmp_path, shm):
    """Under bf16 autocast every float32 gradient is a bf16 value: the log holds them in bf16
    (half the bytes); a step whose gradients were clipped (no longer bf16 values) is logged in
    fp32. A restart replays both kinds to the uninterrupted run's state, bit for bit."""
    reference = {}  # (step 7 clipped: its gradients are no bf16 values)
    _steps(*_objects(), None, 1, 8, reference, bf16=True, clip_at=7)
    run = str(tmp_path / "run")
    model, opt, sched = _objects()
    ck = _checkpointer(run, shm, model, opt, sched)
    _steps(model, opt, sched, ck, 1, 8, bf16=True, clip_at=7)
    ck.wait()
    ck.steplog._written.wait()  # (the entry of step 8 written: a crash after it)
    logs = log_root(memory_tier.root_of(os.path.realpath(run), shm))
    dtypes = {}
    for step in (6, 7, 8):
        held = gockpt.storage.read_manifest(os.path.join(logs, f"step-{step:09d}"))["tensors"]
        dtypes[step] = {v["dtype"] for k, v in held.items() if k.startswith("grad/")}
    assert dtypes == {6: {"BF16"}, 7: {"F32"}, 8: {"F32"}}, dtypes
    restored, state = _restart(run, shm)
    assert restored.step == 8, restored.step
    assert_same(state, reference[8])
    ck.close()
