"""The Python examples of the README and of docs/*.md, run as they are written: each block is
executed in a fresh directory with the names it assumes (a small model, its optimizer and
scheduler, data) and must run without error; what it saves must then verify. The blocks that
cannot run in one CPU process (several GPUs or ranks, a DeepSpeed engine, an object store, an
elided training loop, signatures) are listed below with the test that covers them instead; a
block in neither list fails a test, so a new example is either run here or named."""

import os
import re

import pytest
import torch

import gockpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(f"docs/{p}" for p in os.listdir(os.path.join(ROOT, "docs"))
                               if p.endswith(".md"))

NOT_RUN = {  # (page, block index): why, and where it is covered
    ("docs/deepspeed.md", 0): "a DeepSpeed engine: tests/integrations/test_deepspeed.py",
    ("docs/interval.md", 0): "signatures, not code: tests/test_interval.py",
    ("docs/memory-tier.md", 0): "its training loop is elided: tests/test_memory_tier.py",
    ("docs/resharding.md", 1): "FSDP2 on several ranks: tests/test_many_ranks.py",
    ("docs/resharding.md", 2): "ZeRO on several ranks: tests/integrations/test_deepspeed.py",
    ("docs/transformers.md", 0): "its TrainingArguments are elided: "
                                 "tests/integrations/test_transformers.py",
}


def blocks() -> dict:
    """(page, index) -> the code of every ```python block of the README and docs/."""
    out = {}
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            out[(page, i)] = m.group(1)
    return out


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
    ("docs/resharding.md", 3): (lambda: _saved(_plain()), "checkpoints/run1",
                                _loaded_the_saved, 1),
    ("docs/transformers.md", 1): (_accelerate, "out/run1", _resumed_at_the_end, 2),
}


def test_every_example_is_run_here_or_named_with_its_test():
    found = set(blocks())
    assert not set(SETUP) & set(NOT_RUN)
    assert found - set(SETUP) - set(NOT_RUN) == set(), "examples neither run nor named"
    assert set(SETUP) | set(NOT_RUN) <= found, "listed examples that no page has"


@pytest.mark.parametrize("page,index", list(SETUP), ids=[f"{p}:{i}" for p, i in SETUP])
def test_the_docs_examples_run_as_written(page, index, tmp_path, monkeypatch, request):
    code = blocks()[(page, index)]
    monkeypatch.chdir(tmp_path)
    if (page, index) in S3:  # (a fresh bucket of the server: request's url fixture)
        bucket = request.getfixturevalue("url").split("/")[2]
        monkeypatch.setenv("GOCKPT_DOCS_BUCKET", bucket)
        code = code.replace("s3://my-bucket/", f"s3://{bucket}/")
    setup, run_dir, check, runs = SETUP[(page, index)]
    for _ in range(runs):  # (a second run resumes from what the first saved)
        namespace = setup()
        exec(compile(code, f"{page}:example {index}", "exec"), namespace)
    assert gockpt.verify(run_dir).ok
    if check is not None:
        check(namespace)
