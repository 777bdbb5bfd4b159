"""gockpt in the Hugging Face Trainer (gockpt.integrations.transformers.GockptTrainer): a run
killed with SIGKILL and resumed from gockpt's checkpoint in a fresh process goes on bit for
bit like an uninterrupted one (every later logged loss, the final state) -- one process
resumed in the middle of an epoch, DDP on 2 ranks at an epoch's end; what it cannot follow is
refused. And a loop of one's own with Accelerate, the same way."""

import time

import pytest
import torch

import gockpt
import gockpt.testing
from gockpt.core.errors import CheckpointNotFoundError, ConfigError, UnsupportedOptimizerError
from tests._support import worker_env
from tests._support.dist_ranks import free_port
from tests._support.forked import Forked

transformers = pytest.importorskip("transformers")  # (./run installs it: never skipped there)


def _run(tmp_path, name, world, *flags, expect_killed=False, worker="hf_worker"):
    """The worker on ``world`` ranks (each kills itself at ``die:``)."""
    port = free_port()
    env = [worker_env() if world == 1 else worker_env(
        RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for r in range(world)]
    out = str(tmp_path / f"{name}.pt")
    procs = [Forked(worker, [str(tmp_path / name), out, *flags], e) for e in env]
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        procs[0].join(0.5)
    for p in procs:
        p.kill()
    outputs = [p.communicate() for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == (-9 if expect_killed else 0), stdout + stderr
    return None if expect_killed else torch.load(out, weights_only=True)


@pytest.mark.parametrize("world,die", [(1, 7), (2, 3)])
def test_a_killed_run_resumes_from_gockpt_bit_for_bit(tmp_path, world, die):
    full = _run(tmp_path, "full", world)
    _run(tmp_path, "run", world, f"die:{die}", expect_killed=True)
    saved = gockpt.storage.list_checkpoints(str(tmp_path / "run"))
    assert saved and saved[-1] == f"step-{die - 1:09d}"
    resumed = _run(tmp_path, "run", world, "resume")
    assert resumed["losses"] == [(s, v) for s, v in full["losses"] if s >= die]
    why = gockpt.testing.first_difference(full["state"], resumed["state"], "resumed run")
    assert why is None, why
    metrics = list(gockpt.metrics.read(str(tmp_path / "full"), rank=0))
    assert [m["final_step"] for m in metrics] == list(range(2, 12 // world + 1, 2))
    assert all(m["mode"] == "gockpt-o" and m["overlap_steps"] == 2 for m in metrics), metrics
    assert gockpt.verify(str(tmp_path / "run")).ok


@pytest.mark.parametrize("world,die", [(1, 10), (2, 7)])
def test_an_accelerate_loop_killed_resumes_from_gockpt_bit_for_bit(tmp_path, world, die):
    """A loop of one's own with Accelerate (docs/transformers.md): gockpt's hooks on the torch
    optimizer inside Accelerate's wrapper, gockpt.load after prepare, the data position
    skipped with skip_first_batches -- resumed in the middle of an epoch."""
    pytest.importorskip("accelerate")
    def run(name, *flags, **kw):
        return _run(tmp_path, name, world, *flags, worker="accelerate_worker", **kw)
    full = run("full")
    run("run", f"die:{die}", expect_killed=True)
    saved = gockpt.storage.list_checkpoints(str(tmp_path / "run"))
    assert saved[-1] == f"step-{die // 3 * 3:09d}"  # (a checkpoint every 3 steps)
    resumed = run("run")
    start = resumed["losses"][0][0]
    assert start == die // 3 * 3 + 1
    assert resumed["losses"] == [(s, v) for s, v in full["losses"] if s >= start]
    why = gockpt.testing.first_difference(full["state"], resumed["state"], "resumed loop")
    assert why is None, why


def _trainer(tmp_path, cls=None, **args):
    from gockpt.integrations.transformers import GockptTrainer
    from tests._support.hf_worker import dataset, tiny_model
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / "r"), "per_device_train_batch_size": 4, "max_steps": 2,
        "save_steps": 1, "report_to": [], "disable_tqdm": True, "use_cpu": True, **args})
    return (cls or GockptTrainer)(model=tiny_model(), args=args, train_dataset=dataset(),
                                  eval_dataset=dataset()[:4])


def test_what_the_trainer_cannot_follow_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="load_best_model_at_end"):
        _trainer(tmp_path, load_best_model_at_end=True, eval_strategy="steps",
                 eval_steps=1).train()
    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        _trainer(tmp_path, auto_find_batch_size=True).train()
    with pytest.raises(UnsupportedOptimizerError):
        _trainer(tmp_path, optim="sgd").train()
    with pytest.raises(CheckpointNotFoundError):
        _trainer(tmp_path).train(resume_from_checkpoint=True)
    trainer = _trainer(tmp_path, save_strategy="steps")
    trainer.train()  # (a checkpoint at each of its 2 steps)
    assert gockpt.storage.list_checkpoints(str(tmp_path / "r")) == [
        "step-000000001", "step-000000002"]
    model = transformers.GPT2LMHeadModel(trainer.model.config)
    opt = torch.optim.AdamW(model.parameters())
    gockpt.Checkpointer(model, opt, str(tmp_path / "other"), mode="sync").close()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path / "other"), mode="sync")
    ck.backward_begin(), ck.update_begin()
    ck.save_checkpoint(1, force=True).wait()
    ck.close()
    with pytest.raises(ConfigError, match="holds no Trainer state"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="not a directory"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "r" / "latest"))
    _trainer(tmp_path, transformers.Trainer, output_dir=str(tmp_path / "hf")).train()
    with pytest.raises(ConfigError, match="a Trainer checkpoint folder"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-2"))
