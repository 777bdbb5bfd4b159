"""gockpt in PyTorch Lightning's loop (gockpt.integrations.lightning.GockptCallback): a fit
killed with SIGKILL and resumed from gockpt's checkpoint in a fresh process goes on bit for bit
like an uninterrupted one (every later step's loss, the final state) -- one process in 32-true
and bf16-mixed, DDP and FSDP2 on 2 ranks; what the callback cannot follow is refused."""

import json
import os
import time

import pytest
import torch

import gockpt
import gockpt.testing
from gockpt.core.errors import ConfigError
from tests._support import worker_env
from tests._support.dist_ranks import free_port
from tests._support.forked import Forked

pl = pytest.importorskip("pytorch_lightning")  # (./run installs it: never skipped there)


def _run(tmp_path, name, precision, world, *flags, expect_killed=False):
    """The worker on ``world`` ranks; a rank killed (``die:``) ends the others at once."""
    port = free_port()
    env = [worker_env() if world == 1 else worker_env(
        RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for r in range(world)]
    out = str(tmp_path / f"{name}.pt")
    procs = [Forked("lightning_worker", [str(tmp_path / name), out, precision, *flags], e)
             for e in env]
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if expect_killed and any(p.poll() == -9 for p in procs):
            break  # (the others wait in DDP's collectives for the killed rank)
        procs[0].join(0.5)
    for p in procs:
        p.kill()
    outputs = [p.communicate() for p in procs]
    if expect_killed:
        assert procs[0].returncode == -9, outputs[0]
        return None
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stdout + stderr
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("precision,world,more", [
    ("32-true", 1, ()), ("bf16-mixed", 1, ()), ("32-true", 2, ()), ("bf16-mixed", 2, ()),
    ("32-true", 2, ("fsdp2",))])  # (FSDP2: ModelParallelStrategy, each rank its shards)
def test_a_killed_fit_resumes_from_gockpt_bit_for_bit(tmp_path, precision, world, more):
    fsdp2 = "fsdp2" in more
    full = _run(tmp_path, "full", precision, world, *more, *(("lightning_save",) * fsdp2))
    _run(tmp_path, "run", precision, world, "die:13", *more, expect_killed=True)
    saved = gockpt.storage.list_checkpoints(str(tmp_path / "run"))
    assert saved, "a checkpoint committed before the kill"
    resumed = _run(tmp_path, "run", precision, world, "resume", *more)
    start = min(step for step, _ in resumed["losses"])
    assert f"step-{start:09d}" == saved[-1]  # from the newest checkpoint on
    assert resumed["losses"] == [(s, v) for s, v in full["losses"] if s >= start]
    why = gockpt.testing.first_difference(full["state"], resumed["state"], "resumed fit")
    assert why is None, why
    metrics = [m for m in gockpt.metrics.read(str(tmp_path / "full"), rank=0)]
    assert {m["mode"] for m in metrics} == {"gockpt-o"}
    assert all(m["overlap_steps"] == 2 and m["grad_steps"] == 1 for m in metrics), metrics
    assert gockpt.verify(str(tmp_path / "run")).ok
    if fsdp2:  # Lightning's own distributed checkpoint (a folder) stays Lightning's to load
        again = _run(tmp_path, "full", precision, world, "resume_lightning", *more)
        assert again["losses"] == []  # (at the fit's end already)
        why = gockpt.testing.first_difference(full["state"], again["state"], "Lightning's")
        assert why is None, why
    if world > 1:  # stored under the LightningModule's own names: it loads in one process
        from tests._support.lightning_worker import Small
        alone = Small()
        restored = gockpt.load(str(tmp_path / "run"), alone, restore_rng=False)
        assert restored.step == max(s for s, _ in resumed["losses"]) + 1
        why = gockpt.testing.first_difference(resumed["state"], alone.state_dict(), "alone")
        assert why is None, why


@pytest.mark.parametrize("world,more", [(1, ()), (2, ("fsdp2",)), (1, ("epoch_lr",))])
def test_model_checkpoint_saves_are_gockpt_checkpoints_and_last_resumes_bit_for_bit(tmp_path,
                                                                                     world, more):
    """ModelCheckpoint's saves (each epoch's end, the best two, the last; on 2 ranks under
    FSDP2, each rank its shards) are gockpt
    checkpoints of their steps, its files pointers to them, written once they are durable:
    killed at step 13, ``last.ckpt`` names the checkpoint of the last epoch's end before, and
    ``fit(ckpt_path="last")`` goes on bit for bit, keeping the files the uninterrupted fit
    keeps. ``epoch_lr``: the scheduler is stepped after each epoch's end, before the next
    epoch's start where gockpt takes the boundary of the epoch's last step."""
    epoch = 8 // world  # optimizer steps per epoch (the worker's 8 batches among the ranks)
    full = _run(tmp_path, "full", "32-true", world, "modelcheckpoint", *more)
    _run(tmp_path, "run", "32-true", world, "modelcheckpoint", "die:13", *more,
         expect_killed=True)
    start = 13 // epoch * epoch  # the last epoch's end before the kill
    with open(tmp_path / "run-files" / "last.ckpt") as f:
        assert json.load(f) == {"gockpt_checkpoint": str(tmp_path / "run" / f"step-{start:09d}")}
    resumed = _run(tmp_path, "run", "32-true", world, "modelcheckpoint", "resume", *more)
    assert min(step for step, _ in resumed["losses"]) == start
    assert resumed["losses"] == [(s, v) for s, v in full["losses"] if s >= start]
    why = gockpt.testing.first_difference(full["state"], resumed["state"], "resumed fit")
    assert why is None, why
    # the same files as the uninterrupted fit's, each naming its step's gockpt checkpoint
    names = {f: os.path.basename(p["gockpt_checkpoint"])
             for f, p in resumed["files"]["folder"].items()}
    assert names == {f: os.path.basename(p["gockpt_checkpoint"])
                     for f, p in full["files"]["folder"].items()}
    third, fourth = f"epoch=2-step={3 * epoch}.ckpt", f"epoch=3-step={4 * epoch}.ckpt"
    assert resumed["files"]["listed"] == full["files"]["listed"] == [third, fourth]
    assert names == {third: f"step-{3 * epoch:09d}", fourth: f"step-{4 * epoch:09d}",
                     "last.ckpt": f"step-{4 * epoch:09d}"}
    assert gockpt.verify(str(tmp_path / "run")).ok


def test_the_last_step_is_checkpointed_and_a_fit_resumed_from_it_trains_no_further(tmp_path):
    """max_steps not a multiple of every_n_train_steps: the fit's last step is a checkpoint too
    (announced at the start: copied over the steps up to it); a fit resumed from it ends at
    once, with that state."""
    from gockpt.integrations.lightning import GockptCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(40, 4, generator=torch.Generator().manual_seed(1))), batch_size=4)

    def fit(model, **kw):
        trainer = pl.Trainer(max_steps=15, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[GockptCallback(
                                 tmp_path / "run", every_n_train_steps=4, overlap_steps=2)])
        trainer.fit(model, data, **kw)
        return trainer

    model = Tiny()
    fit(model)
    assert gockpt.storage.list_checkpoints(str(tmp_path / "run")) == \
        [f"step-{s:09d}" for s in (4, 8, 12, 15)]
    last = [m for m in gockpt.metrics.read(str(tmp_path / "run")) if m["final_step"] == 15]
    assert last[0]["overlap_steps"] == 2  # (announced: not copied under a step after it)
    again = Tiny()
    trainer = fit(again, ckpt_path=str(tmp_path / "run"))
    assert trainer.global_step == 15
    why = gockpt.testing.first_difference(model.state_dict(), again.state_dict(), "resumed")
    assert why is None, why


def test_a_file_naming_a_removed_checkpoint_says_so(tmp_path):
    from gockpt.integrations import lightning_files as L
    pointer = tmp_path / "last.ckpt"
    L.write_pointer(str(pointer), str(tmp_path / "run" / "step-000000008"))
    with pytest.raises(ConfigError, match="names the gockpt checkpoint .*step-000000008, which "
                                          "is not there"):
        L.pointed(str(pointer))
    (tmp_path / "other.ckpt").write_bytes(b"PK\x03\x04 a torch.save file")
    assert L.pointed(str(tmp_path / "other.ckpt")) is None


def test_what_the_callback_cannot_follow_is_refused(tmp_path):
    from gockpt.integrations.lightning import GockptCallback

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)))
    for model, precision, said in [(Manual(), "32-true", "manual optimization"),
                                   (Manual(), "64-true", "precision '64-true'")]:
        if precision == "64-true":
            model.automatic_optimization = True
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", precision=precision, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False,
                             callbacks=[GockptCallback(tmp_path / "r", every_n_train_steps=1)])
        with pytest.raises(ConfigError, match=said):
            trainer.fit(model, data)
    with pytest.raises(ConfigError, match="every_n_train_steps must be None or an int >= 1"):
        GockptCallback(tmp_path / "r", every_n_train_steps=0)


@pytest.mark.slow
def test_tensor_parallelism_is_refused_on_every_rank_before_a_step(tmp_path):
    """ModelParallelStrategy with tensor parallelism over 2 ranks: the callback refuses it
    when the fit starts, on both ranks (neither waits for the other), no step trained."""
    got = _run(tmp_path, "tp", "32-true", 2, "tp")
    assert "strategy ModelParallelStrategy is not supported" in got["refused"], got
    assert got["step"] == 0


def test_a_training_step_that_returns_none_steps_without_a_backward(tmp_path):
    """Lightning steps the optimizer even when training_step returns None (no backward ran):
    gockpt's hooks follow it (was: HookOrderError from update_begin)."""
    from gockpt.integrations.lightning import GockptCallback
    from tests._support.lightning_worker import Small

    class Skipping(Small):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 2 else super().training_step(batch, batch_idx)

    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[GockptCallback(tmp_path / "r", every_n_train_steps=2)])
    trainer.fit(Skipping(), torch.utils.data.DataLoader(data, batch_size=8))
    assert [m["final_step"] for m in gockpt.metrics.read(str(tmp_path / "r"))] == [2, 4]
    assert gockpt.verify(str(tmp_path / "r")).ok
