"""Training with PyTorch Lightning and gockpt checkpoints: copy it, replace the model and the data.

    python train.py                     # trains, a checkpoint at the end of each epoch
    python train.py --crash-at 13       # dies abruptly after step 13 (os._exit: no cleanup)
    python train.py                     # resumes from the newest committed checkpoint

It trains a tiny language model (dropout on) with AdamW, a per-step cosine schedule,
gradient accumulation and clipping, in bf16-mixed. The lines marked "gockpt" are all gockpt
needs: the callback, and the run directory as ``ckpt_path`` when a checkpoint exists. A
resumed run continues bit for bit like one that never stopped (weights, AdamW state,
schedule, RNG states, Lightning's loop position); ``--record FILE`` writes the losses and a
digest of the final state to compare runs.
"""

import argparse
import hashlib
import json
import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

import gockpt                                                           # gockpt
from gockpt.integrations.lightning import GockptCallback                # gockpt


class TinyLM(pl.LightningModule):
    """Your LightningModule here: next-token loss of a small embedding-MLP model."""

    def __init__(self, vocab: int, dim: int, total_steps: int, crash_at=None):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Dropout(0.1), nn.Linear(4 * dim, vocab))
        self.total_steps, self.crash_at, self.losses = total_steps, crash_at, {}

    def training_step(self, tokens, batch_idx):
        logits = self.net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        self.losses.setdefault(self.trainer.global_step + 1, []).append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == self.crash_at:
            print(f"step {self.crash_at}: crashing", flush=True)
            os._exit(3)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save-dir", default="checkpoints/lightning_run")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, help="optimizer steps between checkpoints (default: "
                    "an epoch's; Lightning restarts a plain DataLoader's epoch at a resume, so a "
                    "checkpoint in the middle of one resumes exactly only with a resumable loader)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--record", help="write the losses and a digest of the final state here")
    a = ap.parse_args()

    g = torch.Generator().manual_seed(1)  # your data here
    data = DataLoader(torch.randint(0, a.vocab, (a.samples, a.seq_len + 1), generator=g),
                      batch_size=4)
    accumulate = 2
    per_epoch = len(data) // accumulate  # optimizer steps
    torch.manual_seed(0)
    model = TinyLM(a.vocab, a.dim, a.epochs * per_epoch, a.crash_at)
    trainer = pl.Trainer(
        max_epochs=a.epochs, accelerator="cpu", precision="bf16-mixed",
        accumulate_grad_batches=accumulate, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[GockptCallback(a.save_dir, every_n_train_steps=a.every or per_epoch,  # gockpt
                                  overlap_steps=2, keep_last=3)])
    saved = os.path.isdir(a.save_dir) and gockpt.storage.list_checkpoints(a.save_dir)
    trainer.fit(model, data, ckpt_path=a.save_dir if saved else None)    # gockpt
    start = min(model.losses) - 1 if model.losses else trainer.global_step
    print(f"{'resumed from ' + a.save_dir + ' at step ' + str(start) if saved else 'trained from step 0'}"
          f", done at step {trainer.global_step}", flush=True)
    if a.record:
        state = model.state_dict()
        digest = hashlib.sha256()
        for name in sorted(state):
            digest.update(name.encode() + state[name].detach().cpu().numpy().tobytes())
        losses = {step: sum(v) / len(v) for step, v in model.losses.items()}
        with open(a.record, "w") as f:
            json.dump({"start": start, "losses": losses, "digest": digest.hexdigest()}, f)


if __name__ == "__main__":
    main()
