"""The memory tier (Config.memory): each committed checkpoint also kept in host shared memory,
loaded instead of the disk's only when it is the one the disk's latest names and verifies
completely; never a damaged
or half-written copy; the space checked when the Checkpointer is built; removed at the end of
training (close(), gockpt clean --memory) and kept when the process dies."""

import os
import tempfile

import pytest
import torch

import gockpt
from gockpt.core.errors import ConfigError
from gockpt.storage import memory_tier, peers
from gockpt.storage.commit import write_latest
from gockpt.testing import assert_same, snapshot
from tests._support import worker_env
from tests._support.cli_helpers import flip_byte
from tests._support.forked import run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def shm():
    """A memory directory of the test's own (on a tmpfs where there is one)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="gockpt-test-shm-", dir=base) as d:
        yield d


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(model, opt, ck, steps, first=1):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for step in range(first, first + steps):
        loss = model(x).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step)


def _trained(directory, shm, steps=6, **options):
    """A Checkpointer left open after ``steps`` steps (a checkpoint every 3): the process as
    a crash finds it. Returns (model, optimizer, checkpointer, snapshot at the last step)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=3, memory="auto", memory_dir=shm, **options)
    _train(model, opt, ck, steps)
    ck.wait()
    return model, opt, ck, snapshot(model, opt)


def _load(directory, shm, **kw):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restored = gockpt.load(directory, model, opt, memory_dir=shm, **kw)
    return restored, snapshot(model, opt)


def test_the_newest_checkpoint_is_kept_in_memory_and_loaded_from_there_bitwise(tmp_path, shm):
    run = str(tmp_path / "run")
    _, _, ck, at_6 = _trained(run, shm)
    root = memory_tier.root_of(os.path.realpath(run), shm)
    assert sorted(os.listdir(root)) == ["latest", "run", "step-000000006"]  # the previous: gone
    assert gockpt.verify(root).ok
    restored, got = _load(run, shm)
    assert restored.path == os.path.join(root, "step-000000006") and restored.step == 6
    assert_same(got, at_6)
    ck.close()
    assert not os.path.exists(root), "close() at the end of training removes the copies"
    restored, got = _load(run, shm)  # (from disk now)
    assert restored.path == os.path.join(os.path.realpath(run), "step-000000006")
    assert_same(got, at_6)


def test_a_damaged_memory_copy_is_never_loaded_the_disk_is(tmp_path, shm):
    run = str(tmp_path / "run")
    _, _, ck, at_6 = _trained(run, shm)
    root = memory_tier.root_of(os.path.realpath(run), shm)
    flip_byte(os.path.join(root, "step-000000006"), "model/0.weight")  # one bit of the copy
    with pytest.warns(RuntimeWarning, match=r"memory copy .*step-000000006 does not verify "
                                            r"\(.*data.safetensors.*\); loading .* from disk"):
        restored, got = _load(run, shm)
    assert restored.path == os.path.join(os.path.realpath(run), "step-000000006")
    assert_same(got, at_6)
    ck.close()


def test_a_half_written_or_older_copy_is_not_taken(tmp_path, shm):
    run = str(tmp_path / "run")
    model, opt, ck, _ = _trained(run, shm)
    root = memory_tier.root_of(os.path.realpath(run), shm)
    # a copy being written when the process died: a temporary directory, never named latest
    os.makedirs(os.path.join(root, ".tmp-step-000000009-123-abcd"))
    restored, _ = _load(run, shm)
    assert restored.path == os.path.join(root, "step-000000006")
    ck.tiers.memory.limit = 1  # step 9 is not kept in memory: the disk's is newer than the copy
    with pytest.warns(RuntimeWarning, match="checkpoint step-000000009 not kept in memory"):
        _train(model, opt, ck, 3, first=7)
        ck.wait()
    at_9 = snapshot(model, opt)
    restored, got = _load(run, shm)
    assert restored.path == os.path.join(os.path.realpath(run), "step-000000009")
    assert_same(got, at_9)
    ck.close()


def test_a_latest_moved_back_on_disk_is_what_loads(tmp_path, shm):
    # the user points the disk's latest at an older checkpoint on purpose (a rollback): the
    # memory copy of the newer one must not be taken over it (was: any copy at least as new)
    run = str(tmp_path / "run")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = gockpt.Checkpointer(model, opt, run, mode="gockpt-o", overlap_steps=2, interval=3,
                             memory="auto", memory_dir=shm, keep_last=None)
    _train(model, opt, ck, 3)
    ck.wait()
    at_3 = snapshot(model, opt)
    _train(model, opt, ck, 3, first=4)
    ck.wait()
    write_latest(os.path.realpath(run), "step-000000003")
    restored, got = _load(run, shm)
    assert restored.step == 3
    assert restored.path == os.path.join(os.path.realpath(run), "step-000000003")
    assert_same(got, at_3)
    ck.close()


def test_another_runs_copies_are_never_taken(tmp_path, shm):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _, _, ck_a, _ = _trained(a, shm)
    root_a = memory_tier.root_of(os.path.realpath(a), shm)
    root_b = memory_tier.root_of(os.path.realpath(b), shm)
    os.rename(root_a, root_b)  # a's copies where b's would be (their run file names a)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(gockpt.CheckpointNotFoundError, match="does not exist"):
        gockpt.load(b, model, opt, memory_dir=shm)
    assert not memory_tier.remove(os.path.realpath(b), shm), "nor removed as b's"
    assert os.path.isdir(root_b)
    os.rename(root_b, root_a)
    ck_a.close()


def test_the_space_is_checked_when_the_checkpointer_is_built(tmp_path, shm):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"memory=1000 bytes is less than two copies of this "
                                          r"process's checkpoint need \(\d+ bytes"):
        gockpt.Checkpointer(model, opt, str(tmp_path / "r"), memory=1000, memory_dir=shm)
    with pytest.raises(ConfigError, match="memory_dir .* is not a directory"):
        gockpt.Checkpointer(model, opt, str(tmp_path / "r"), memory="auto",
                            memory_dir=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="memory must be None, 'auto' or a number"):
        gockpt.Checkpointer(model, opt, str(tmp_path / "r"), memory="1G")
    free = memory_tier.free_bytes(shm)
    with pytest.raises(ConfigError, match=r"has [\d.]+ MiB free; two copies"):
        memory_tier.budget(free * 4, shm, free)
    with pytest.warns(RuntimeWarning, match="the memory tier is off: .* free, two copies"):
        assert memory_tier.budget("auto", shm, free) is None


def test_a_host_holds_its_peers_parts_but_only_its_own_ranks_step_logs(shm):
    # 4 ranks on 2 hosts: host 0 holds its 2 ranks' parts and the 2 it keeps for host 1's,
    # but a step log stays with its rank (was: 4 logs counted, a fitting log refused)
    hosts = peers.Hosts.of([7, 7, 3, 3], 0)
    assert hosts.host_of(1) == (0, 1) and hosts.host_of(2) == (2, 3)
    assert hosts.parts_on_host(0) == 4 and hosts.kept_by(0) == [2]
    free = memory_tier.free_bytes(shm)
    copies = 2 * (1 << 10) * 4 + (1 << 20)
    log = (free - copies) // 3  # (2 logs fit with a third of the space to spare; 4 would not)
    assert memory_tier.budget("auto", shm, 1 << 10, hosts.parts_on_host(0), log,
                              log_processes=len(hosts.host_of(0))) >= copies
    with pytest.raises(ConfigError, match=rf"memory_log={free} for each of the 2 ranks, "
                                          rf"{2 * free} in all"):
        memory_tier.budget("auto", shm, 1 << 10, hosts.parts_on_host(0), free,
                           log_processes=len(hosts.host_of(0)))


def test_a_copy_that_cannot_be_written_leaves_the_disk_checkpoint_standing(tmp_path, shm):
    run = str(tmp_path / "run")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = gockpt.Checkpointer(model, opt, run, mode="gockpt-o", overlap_steps=2, interval=3,
                             memory="auto", memory_dir=shm)
    ck.tiers.memory.limit = 1  # the checkpoint outgrew the tier
    with pytest.warns(RuntimeWarning, match="checkpoint step-000000003 not kept in memory"):
        _train(model, opt, ck, 3)
        ck.wait()
    assert gockpt.verify(run).ok
    ck.close()


def test_a_killed_process_restarts_from_its_memory_copy(tmp_path, shm):
    """kill -9 after a checkpoint: the restart loads the memory copy, bit for bit the state
    the killed process had at that step (what an uninterrupted run computes here), and the
    end of the restarted run removes the copies."""
    run = str(tmp_path / "run")
    code = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
from tests.test_memory_tier import _trained
_trained({run!r}, {shm!r}, steps=7)
os.kill(os.getpid(), signal.SIGKILL)
"""
    script = tmp_path / "killed.py"
    script.write_text(code)
    # (its own process, forked from the tests' server that imported torch once)
    proc = run_worker(str(script), env=worker_env(), timeout=120)
    assert proc.returncode == -9, proc.stderr
    root = memory_tier.root_of(os.path.realpath(run), shm)
    assert os.path.isdir(os.path.join(root, "step-000000006")), "kept when the process dies"
    restored, got = _load(run, shm)
    assert restored.path == os.path.join(root, "step-000000006")
    _, _, ck, expected = _trained(str(tmp_path / "uninterrupted"), shm)
    assert_same(got, expected)
    ck.close()


def test_gockpt_clean_removes_the_copies_of_a_run_that_no_longer_runs(tmp_path, shm, capsys):
    from gockpt.cli import main
    run = os.path.realpath(str(tmp_path / "run"))
    _, _, ck, _ = _trained(run, shm)
    root = memory_tier.root_of(run, shm)
    assert main(["clean", run, "--memory", "--memory-dir", shm]) == 0
    assert "the memory copies stay: a Checkpointer of this directory is running" in \
        capsys.readouterr().out
    assert os.path.isdir(root)
    ck._close(end_of_training=False)  # (as a process leaving on an exception: copies kept)
    assert os.path.isdir(root)
    assert main(["clean", run, "--memory", "--memory-dir", shm]) == 0
    assert f"removed the memory copies {root}" in capsys.readouterr().out
    assert not os.path.exists(root)
    assert main(["clean", run, "--memory", "--memory-dir", shm]) == 0
    assert "no memory copies of this directory" in capsys.readouterr().out


@pytest.mark.parametrize("scenario", ["load", "hosts", "ring", "log", "fsdp2log"])
def test_several_ranks_keep_their_copy_in_memory_and_load_it_together(
        tmp_path, shm, monkeypatch, scenario):
    """DDP on 2 gloo ranks: the copy in memory is the whole checkpoint (both parts and the
    top manifest), loaded on every rank bitwise; a damaged byte in one rank's part makes
    every rank load the disk's. Ranks declared on two hosts (4 ranks): a host whose memory was
    lost takes its ranks' parts from their peers on the other host, bitwise, and so does a
    restart in fresh processes; a part that neither its host nor its peer holds (or whose
    peer's copy is damaged): every rank loads the disk's; FSDP2 on 3 ranks on 3 hosts, each host holding its own part
    and the previous rank's: the rank whose host lost its memory takes its part from the
    next one. The step log, DDP and FSDP2 (each rank its shards): every
    rank resumes at the last step every rank logged whole, bitwise."""
    from tests._support.dist_ranks import run_ranks
    monkeypatch.setenv("GOCKPT_TEST_SHM", shm)
    run_ranks(tmp_path / "run", scenario, world={"hosts": 4, "ring": 3}.get(scenario, 2),
              worker="memory_worker")
    if scenario == "hosts":  # every rank died; restarted with host 1's memory lost
        run_ranks(tmp_path / "run", "hosts-restart", world=4, worker="memory_worker")


def test_the_tiers_finish_uploads_first_and_one_that_fails_does_not_stop_the_others():
    """``close()`` (``Tiers.finish``): the uploads the job owes are waited for before the memory
    copies go (the reverse of the order the tiers are handed a checkpoint), and a tier whose
    end raises does not keep the others from ending: its error is raised after."""
    from gockpt.tiers import Tiers
    ended = []

    class Tier:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def finish(self, end_of_training):
            ended.append((self.name, end_of_training))
            if self.fails:
                raise OSError(f"{self.name} could not end")

    tiers = object.__new__(Tiers)  # (its tiers only: what finish() walks)
    tiers.tiers = [Tier("memory"), Tier("remote", fails=True)]
    with pytest.raises(OSError, match="remote could not end"):
        tiers.finish(True)
    assert ended == [("remote", True), ("memory", True)]
