"""One rank of tests/integrations/test_lightning.py's runs: ``python -m
tests._support.lightning_worker RUN_DIR OUT PRECISION [resume] [die:STEP] [modelcheckpoint] [epoch_lr]``
trains a small
LightningModule for 4 epochs (AdamW, a per-step StepLR, gradient clipping, the data in order)
with :class:`gockpt.integrations.lightning.GockptCallback` (gockpt-o, K=2, a checkpoint at the
end of every epoch), resumed from RUN_DIR's newest checkpoint with ``resume``, killed with
SIGKILL at the training step ``die:STEP`` once the checkpoints so far are durable; rank 0 writes each step's loss and the final
state to OUT. With ``modelcheckpoint``, gockpt's checkpoints are a ModelCheckpoint's saves (at
each epoch's end, the best two by the training loss and the last: files in RUN_DIR-files,
which OUT lists) and ``resume`` is from ``"last"``; ``epoch_lr``: the scheduler halves the rate
after each epoch (Lightning steps it after the epoch's end). Several ranks (RANK / WORLD_SIZE set, as torchrun's): DDP, Lightning seeing
torchrun's environment; ``fsdp2``: FSDP2 instead (ModelParallelStrategy, the layers sharded
in ``configure_model``), the final state gathered; ``lightning_save``: Lightning's own
checkpoint written after the fit to RUN_DIR-lightning, and ``resume_lightning`` resumes from it
(the callback present: it stays Lightning's to load); ``tp``: ModelParallelStrategy's tensor
parallelism, which the callback refuses (rank 0 writes the error to OUT)."""

import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from gockpt.core.errors import ConfigError
from gockpt.integrations.lightning import GockptCallback, pl

ModelCheckpoint = pl.callbacks.ModelCheckpoint

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
BATCHES = 8 // WORLD  # per epoch and rank (DDP's sampler splits the 8 batches)


class Small(pl.LightningModule):
    def __init__(self, die_at=None, epoch_lr=False, fsdp2=False):
        super().__init__()
        self.epoch_lr, self.fsdp2 = epoch_lr, fsdp2
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.Tanh(),
                                       torch.nn.Linear(128, 1))
        self.losses, self.die_at = [], die_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.trainer.global_step, loss.item()))
        self.log("train_loss", loss)
        if self.trainer.global_step == self.die_at:
            self.gockpt.wait()  # (the checkpoints so far durable: the kill comes after)
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    def configure_model(self):
        if self.fsdp2:  # (ModelParallelStrategy calls it on each rank, its device mesh set)
            from tests._support.ranks_worker import fsdp2
            fsdp2(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.epoch_lr:  # (stepped by Lightning after each epoch's end: after F)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def kept_files(run, saves) -> dict:
    """Every file in ModelCheckpoint's folder -> what it holds (JSON: a gockpt pointer), and
    which of them it lists as its best."""
    folder = f"{run}-files"
    return {"listed": sorted(os.path.basename(p) for p in saves.best_k_models),
            "folder": {f: json.load(open(os.path.join(folder, f)))
                       for f in sorted(os.listdir(folder))}}


def strategy(flags):
    """DDP on several ranks; with ``fsdp2``, FSDP2 (ModelParallelStrategy, data parallel);
    with ``tp``, ModelParallelStrategy's tensor parallelism over every rank."""
    if "fsdp2" in flags or "tp" in flags:
        from pytorch_lightning.strategies import ModelParallelStrategy
        tp = WORLD if "tp" in flags else 1
        return ModelParallelStrategy(data_parallel_size=WORLD // tp, tensor_parallel_size=tp)
    return "ddp" if WORLD > 1 else "auto"


def main():
    run, out, precision, *flags = sys.argv[1:]
    die = next((int(f.split(":")[1]) for f in flags if f.startswith("die:")), None)
    if WORLD > 1:  # torchrun's environment, as Lightning detects it
        os.environ.update(LOCAL_RANK=os.environ["RANK"], GROUP_RANK="0",
                          LOCAL_WORLD_SIZE=str(WORLD), TORCHELASTIC_RUN_ID="gockpt-test")
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    model = Small(die, epoch_lr="epoch_lr" in flags, fsdp2="fsdp2" in flags)
    files = "modelcheckpoint" in flags  # ModelCheckpoint's saves at each epoch's end: gockpt's
    model.gockpt = GockptCallback(run, every_n_train_steps=None if files else BATCHES,
                                  overlap_steps=2,
                                  block_bytes=1024)  # (several blocks of this small state)
    saves = [ModelCheckpoint(dirpath=f"{run}-files", every_n_train_steps=BATCHES, save_top_k=2,
                             monitor="train_loss", save_last=True)] if files else []
    trainer = pl.Trainer(
        max_epochs=4, accelerator="cpu", devices=WORLD,
        strategy=strategy(flags), precision=precision,
        callbacks=[model.gockpt, *saves],
        gradient_clip_val=0.5, logger=False, enable_checkpointing=files,
        enable_progress_bar=False, enable_model_summary=False)
    resume = ("last" if files else run) if "resume" in flags else None
    if "resume_lightning" in flags:
        resume = f"{run}-lightning"
    if "tp" in flags:  # refused when the fit starts, on every rank alike
        try:
            trainer.fit(model, DataLoader(data, batch_size=8))
        except ConfigError as exc:
            if trainer.global_rank == 0:
                torch.save({"refused": str(exc), "step": trainer.global_step}, out)
            print(f"rank {trainer.global_rank}: refused", flush=True)
            return
        raise AssertionError("tensor parallelism was not refused")
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=resume)
    if "lightning_save" in flags:  # after fit: Lightning's own save (FSDP2: a folder, meta.pt)
        trainer.save_checkpoint(f"{run}-lightning")
    state = model.state_dict()
    if "fsdp2" in flags:  # (gathered on every rank: a collective)
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if trainer.global_rank == 0:
        torch.save({"losses": model.losses, "state": state,
                    "files": kept_files(run, saves[0]) if files else None}, out)
    print(f"rank {trainer.global_rank}: done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
