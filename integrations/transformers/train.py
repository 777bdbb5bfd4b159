"""Training with the Hugging Face Trainer and gockpt checkpoints: copy it, replace the model and
the data.

    python train.py                     # trains, a checkpoint every --save-steps steps
    python train.py --crash-at 13       # dies abruptly after step 13 (os._exit: no cleanup)
    python train.py                     # resumes from the newest committed checkpoint

It trains a tiny GPT-2 (dropout on) with the Trainer's defaults (AdamW), a cosine schedule
with warmup, gradient accumulation and clipping. The lines marked "gockpt" are all gockpt
needs: ``GockptTrainer`` in place of ``Trainer`` and ``resume_from_checkpoint`` when a
checkpoint exists. A resumed run continues bit for bit like one that never stopped;
``--record FILE`` writes the losses and a digest of the final state to compare runs.
"""

import argparse
import hashlib
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import gockpt                                                           # gockpt
from gockpt.integrations.transformers import GockptTrainer             # gockpt


def token_data(samples: int, seq_len: int, vocab: int) -> list:
    """Your tokenized dataset here: random token sequences."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (samples, seq_len), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


class Crash(TrainerCallback):
    """--crash-at: end the process abruptly after that step; --record: the logged losses."""

    def __init__(self, crash_at):
        self.crash_at, self.losses, self.start = crash_at, {}, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = state.global_step  # (a resumed run: the checkpoint's step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.crash_at:
            print(f"step {state.global_step}: crashing", flush=True)
            os._exit(3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save-dir", default="checkpoints/hf_run")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--record", help="write the losses and a digest of the final state here")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_positions=a.seq_len, n_embd=a.dim,
                                       n_layer=a.layers, n_head=4))
    args = TrainingArguments(
        output_dir=a.save_dir, num_train_epochs=a.epochs, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.1,
        lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0, logging_steps=1,
        save_steps=a.save_steps, save_total_limit=3, report_to=[], disable_tqdm=True, seed=0)
    crash = Crash(a.crash_at)
    trainer = GockptTrainer(model=model, args=args,                       # gockpt
                            train_dataset=token_data(a.samples, a.seq_len, a.vocab),
                            callbacks=[crash], gockpt_options={"overlap_steps": 2})
    saved = os.path.isdir(a.save_dir) and gockpt.storage.list_checkpoints(a.save_dir)
    trainer.train(resume_from_checkpoint=bool(saved))                    # gockpt
    print(f"{'resumed from ' + a.save_dir + ' at step ' + str(crash.start) if saved else 'trained from step 0'}"
          f", done at step {trainer.state.global_step}", flush=True)
    if a.record:
        state = trainer.model.state_dict()
        digest = hashlib.sha256()
        for name in sorted(state):
            digest.update(name.encode() + state[name].detach().cpu().numpy().tobytes())
        with open(a.record, "w") as f:
            json.dump({"start": crash.start, "losses": crash.losses,
                       "digest": digest.hexdigest()}, f)


if __name__ == "__main__":
    main()
