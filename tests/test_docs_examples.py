"""The Python examples of the README and of docs/*.md, run as they are written: each block is
executed in a fresh directory with the names it assumes (a small model, its optimizer and
scheduler, data, a checkpoint it loads) and must run without error; what it saves must then
verify, and what it loads must be what was saved. The examples of DeepSpeed and of several
ranks run in rank processes of their own (``IN_RANKS``), after the ranks that save what
they load; an example written for a GPU runs on the CPU with the one argument the framework
asks for there (``ON_CPU``). A block run by neither test fails a third, so that every new
example is run."""

import json
import os

import pytest
import torch

import gockpt
from tests._support.dist_ranks import run_ranks
from tests._support.docs_blocks import blocks
from tests._support.docs_worker import DEEPSPEED, SAVED_AT

def _plain():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    return {"torch": torch, "gockpt": gockpt, "model": model, "optimizer": optimizer,
            "scheduler": scheduler}


def _saved(ns):
    """A checkpoint of ``ns``'s model in checkpoints/run1 (what the loading examples load);
    then a fresh model and optimizer of other values in ``ns`` to load it into, and the saved
    state as ``ns["saved"]``."""
    with gockpt.Checkpointer(ns["model"], ns["optimizer"], "checkpoints/run1",
                             scheduler=ns["scheduler"], mode="sync") as ck:
        ck.backward_begin()
        ns["model"](torch.randn(2, 8)).square().mean().backward()
        ck.update_begin()
        ns["optimizer"].step()
        ns["scheduler"].step()
        ck.save_checkpoint(1, force=True)
    saved = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    torch.manual_seed(1)
    return {**_plain(), "saved": saved}


def _loaded_the_saved(ns) -> None:
    got = ns["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in ns["saved"].items())


def _custom_loop():
    ns = _plain()
    x = torch.randn(4, 8)
    return {**ns, "compute_loss": lambda model, step: model(x).square().mean(), "start": 0,
            "total": 100, "epoch": 0}


def _lightning():
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(50 * 4, 8))
    return {"pl": pl, "model": Module(), "train_loader": DataLoader(data, batch_size=4)}


def _lightning_saves():
    from pytorch_lightning.callbacks import ModelCheckpoint

    from gockpt.integrations.lightning import GockptCallback
    ns = _lightning()
    module = ns["model"]

    def validation_step(batch, batch_idx):
        module.log("val_loss", module.net(batch[0]).square().mean())
    module.validation_step = validation_step
    return {**ns, "ModelCheckpoint": ModelCheckpoint, "GockptCallback": GockptCallback,
            "val_loader": ns["train_loader"]}


def _saved_as_pointers(ns) -> None:
    files = sorted(os.listdir("checkpoints/files"))
    assert files == ["epoch=9-step=500.ckpt", "last.ckpt"], files
    for f in files:
        with open(os.path.join("checkpoints/files", f)) as fh:
            assert fh.read().startswith('{"gockpt_checkpoint": ')
    assert ns["trainer"].global_step == 500


def _accelerate():
    from accelerate import Accelerator
    ns = _plain()
    data = torch.utils.data.DataLoader(torch.randn(500 * 2, 8), batch_size=2)  # 500 steps
    return {**ns, "accelerator": Accelerator(cpu=True), "opt": ns["optimizer"],
            "sched": ns["scheduler"], "loader": data,
            "loss_fn": lambda model, batch: model(batch).square().mean()}


def _resumed_at_the_end(ns) -> None:
    assert ns["start"] == 500  # (run again: from its checkpoint of step 500, nothing left)


def _dcp_names(ns):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gockpt.storage.dcp import GockptWriter
    model_sd, optim_sd = get_state_dict(ns["model"], ns["optimizer"])
    return {**ns, "dcp": dcp, "GockptWriter": GockptWriter, "step": 5,
            "state": {"model": model_sd, "optimizer": optim_sd}}


def _dcp_uploaded(ns) -> None:
    from gockpt.storage.dcp import wait_uploads
    url = f"s3://{os.environ['GOCKPT_DOCS_BUCKET']}/runs/run1"
    [status] = [s for s in wait_uploads(120) if s.url == url]
    name = gockpt.storage.checkpoint_name(5)
    assert status.error is None and status.uploaded == [name], status
    assert gockpt.verify(f"{url}/{name}").ok


def _restored_from_the_store(ns) -> None:
    assert ns["restored"].step == 100 and ns["restored"].path.startswith("s3://")


def _measured_run():
    """checkpoints/run1 with three checkpoints of measured stall and step time (what the
    interval example reads), then fresh objects."""
    ns = _custom_loop()
    with gockpt.Checkpointer(ns["model"], ns["optimizer"], "checkpoints/run1", mode="sync",
                             interval=2) as ck:
        for step in range(6):
            ck.backward_begin()
            ns["compute_loss"](ns["model"], step).backward()
            ck.update_begin()
            ns["optimizer"].step()
            ns["optimizer"].zero_grad()
            ck.save_checkpoint(step + 1)
    return _custom_loop()


def _interval_chosen(ns) -> None:
    assert ns["best"].name == "sync" and ns["best"].n_best_steps >= 1
    assert ns["ck"].config.interval == ns["best"].n_best_steps
    ns["ck"].close()


def _restarted_from_memory(ns) -> None:
    """The load with the step log: the copy of step 200, then the logged steps after it up to
    the last one logged whole (249 or 250: the last entry may still be on its way)."""
    ns["ck"].close()  # (the end of training: the copies and the log removed)
    restored = ns["restored"]
    assert restored.step in (249, 250) and os.sep + "log" + os.sep in restored.path, restored
    assert restored.path.startswith("/dev/shm/gockpt-"), restored.path
    assert not os.path.exists(os.path.dirname(os.path.dirname(restored.path)))


def _hf_trainer():
    from tests._support.hf_worker import dataset, tiny_model
    return {"model": tiny_model(), "train": dataset()}


def _trained_to_the_end(ns) -> None:
    assert ns["trainer"].state.global_step == 100
    assert gockpt.storage.list_checkpoints("out/run1") == ["step-000000050", "step-000000100"]


def _saved_by_fsdp2():
    """checkpoints/run1 saved by FSDP2 on 2 ranks (tests/_support/docs_worker.py), and the
    names of the example that evaluates it in this process."""
    from tests._support import docs_worker
    run_ranks(os.getcwd(), json.dumps({"run": "save", "kind": "fsdp2"}), world=2,
              worker="docs_worker", timeout=180)
    return {"gockpt": gockpt, "build_model": docs_worker.build_model}


def _loaded_whole(ns) -> None:
    saved = torch.load("saved-model.pt")
    got = ns["model"].state_dict()
    assert got.keys() == saved.keys() and all(torch.equal(got[k], v) for k, v in saved.items())


# The examples that name an S3 store run against a real one (SeaweedFS, as tests/test_remote.py):
# its bucket "my-bucket" stands for a fresh bucket of each test.
S3 = {("docs/dcp.md", 1), ("docs/object-storage.md", 0)}


SETUP = {  # (page, block index): the names the block assumes, the run directory to verify,
    #        what to check of the names after it ran, and how many times it runs there
    ("README.md", 0): (_custom_loop, "checkpoints/run1", None, 1),
    ("docs/dcp.md", 0): (lambda: {**_plain(), "step": 5}, "checkpoints/run1", None, 1),
    ("docs/dcp.md", 1): (lambda: _dcp_names(_plain()), "checkpoints/run1", _dcp_uploaded, 1),
    ("docs/object-storage.md", 0): (_custom_loop, "checkpoints/run1",
                                    _restored_from_the_store, 1),
    ("docs/lightning.md", 0): (_lightning, "checkpoints/run1", None, 1),
    ("docs/lightning.md", 1): (_lightning_saves, "checkpoints/run1", _saved_as_pointers, 1),
    ("docs/resharding.md", 0): (lambda: _saved(_plain()), "checkpoints/run1",
                                _loaded_the_saved, 1),
    ("docs/resharding.md", 1): (_saved_by_fsdp2, "checkpoints/run1", _loaded_whole, 1),
    ("docs/resharding.md", 4): (lambda: _saved(_plain()), "checkpoints/run1",
                                _loaded_the_saved, 1),
    ("docs/transformers.md", 1): (_accelerate, "out/run1", _resumed_at_the_end, 2),
    ("docs/interval.md", 0): (_measured_run, "checkpoints/run1", _interval_chosen, 1),
    ("docs/memory-tier.md", 0): (_custom_loop, "checkpoints/run1", _restarted_from_memory, 1),
    ("docs/transformers.md", 0): (_hf_trainer, "out/run1", _trained_to_the_end, 1),
}

# The examples written for a GPU (the Trainer's bf16=True): on a machine without one, the
# Trainer asks for use_cpu=True, which is added to the code as run here.
ON_CPU = {("docs/transformers.md", 0): ("bf16=True", "bf16=True, use_cpu=True")}
# Sizes written for a real model, made to fit any test machine's tmpfs (a container's may
# have 64 MB): the tiny model's log entries are a few KiB.
SMALLER = {("docs/memory-tier.md", 0): ("memory_log=8 << 30", "memory_log=64 << 20")}


def test_every_example_is_run():
    found = set(blocks())
    assert not set(SETUP) & set(IN_RANKS)
    assert found - set(SETUP) - set(IN_RANKS) == set(), "examples not run"
    assert set(SETUP) | set(IN_RANKS) <= found, "listed examples that no page has"


# Run in rank processes of their own (tests/_support/docs_worker.py): DeepSpeed and FSDP2 set
# up torch.distributed, which this process must not. The ranks that save what an example
# loads: (worker, its scenario, ranks, where its checkpoints go), and how many ranks the
# example runs on.
IN_RANKS = {
    ("docs/deepspeed.md", 0): (None, 1),
    ("docs/resharding.md", 2): (("docs_worker", {"run": "save", "kind": "ddp"}, 4, None), 2),
    ("docs/resharding.md", 3): (("deepspeed_worker", {"run": "save", "stage": 1,
                                                      "steps": SAVED_AT, "save_at": [SAVED_AT]},
                                 2, "checkpoints/ds_run"), 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("page,index", list(IN_RANKS), ids=[f"{p}:{i}" for p, i in IN_RANKS])
def test_the_examples_with_ranks_run_as_written_in_ranks_of_their_own(tmp_path, page, index):
    if (page, index) in DEEPSPEED:
        pytest.importorskip("deepspeed")
    saved_by, world = IN_RANKS[(page, index)]
    if saved_by is not None:
        worker, scenario, ranks, moved_to = saved_by
        out = tmp_path / "saved" if moved_to else tmp_path
        out.mkdir(exist_ok=True)
        run_ranks(out, json.dumps(scenario), world=ranks, worker=worker, timeout=180)
        if moved_to:  # (deepspeed_worker saves into OUT/ckpt)
            os.makedirs(os.path.dirname(tmp_path / moved_to), exist_ok=True)
            os.rename(out / "ckpt", tmp_path / moved_to)
    run_ranks(tmp_path, json.dumps({"run": "example", "page": page, "index": index}),
              world=world, worker="docs_worker", timeout=180)


# The examples whose setup starts ranks: with the slow tests.
SLOW = {("docs/resharding.md", 1)}


@pytest.mark.parametrize("page,index", [
    pytest.param(p, i, id=f"{p}:{i}", marks=[pytest.mark.slow] if (p, i) in SLOW else [])
    for p, i in SETUP])
def test_the_docs_examples_run_as_written(page, index, tmp_path, monkeypatch, request):
    code = blocks()[(page, index)]
    monkeypatch.chdir(tmp_path)
    if (page, index) in S3:  # (a fresh bucket of the server: request's url fixture)
        bucket = request.getfixturevalue("url").split("/")[2]
        monkeypatch.setenv("GOCKPT_DOCS_BUCKET", bucket)
        code = code.replace("s3://my-bucket/", f"s3://{bucket}/")
    changes = [SMALLER.get((page, index))]
    if not torch.cuda.is_available():
        changes.append(ON_CPU.get((page, index)))
    for old, new in filter(None, changes):
        assert old in code, f"{page}: example {index} no longer says {old!r}"
        code = code.replace(old, new)
    setup, run_dir, check, runs = SETUP[(page, index)]
    namespace: dict = {}
    try:
        for _ in range(runs):  # (a second run resumes from what the first saved)
            namespace = setup()
            exec(compile(code, f"{page}:example {index}", "exec"), namespace)
        assert gockpt.verify(run_dir).ok
        if check is not None:
            check(namespace)
    finally:  # (a failed example leaves no Checkpointer running here, nor memory copies)
        if isinstance(namespace.get("ck"), gockpt.Checkpointer):
            namespace["ck"].close()
