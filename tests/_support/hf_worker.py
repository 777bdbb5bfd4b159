"""One rank of tests/integrations/test_transformers.py's runs: ``python -m
tests._support.hf_worker RUN_DIR OUT [resume] [die:STEP]`` trains a tiny GPT-2 (dropout on:
the RNG states matter) for 3 epochs with :class:`gockpt.integrations.transformers.GockptTrainer`
(the Trainer's default AdamW, a linear schedule, gradient accumulation over 2 micro-batches,
clipping, the data shuffled; gockpt-o, K=2, a checkpoint every 2 steps), resumed from RUN_DIR's
newest checkpoint with ``resume``, killed with SIGKILL at the end of the optimizer step
``die:STEP`` once the checkpoints so far are durable; rank 0 writes each step's logged loss and
the final state to OUT. Several ranks (RANK / WORLD_SIZE set, as torchrun's): DDP over gloo."""

import os
import signal
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from gockpt.integrations.transformers import GockptTrainer

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
SAMPLES = 32  # 8 batches of 4 per epoch (split between the ranks)


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=2))


def dataset() -> list:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (SAMPLES, 16), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


class Record(TrainerCallback):
    """Each logged loss; SIGKILL after step ``die`` once gockpt's checkpoints are durable; a
    random draw at each step's start, as a callback may make (the RNG states of a checkpoint
    are taken before it)."""

    def __init__(self, die):
        self.losses, self.die, self.trainer = [], die, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, logs["loss"]))

    def on_step_begin(self, args, state, control, **kwargs):
        torch.rand(1)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.die:
            self.trainer.ck.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    run, out, *flags = sys.argv[1:]
    die = next((int(f.split(":")[1]) for f in flags if f.startswith("die:")), None)
    torch.set_num_threads(1)  # (the same arithmetic however busy the cores: runs compared)
    if WORLD > 1:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    args = TrainingArguments(
        output_dir=run, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=3, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5,
        save_steps=2, logging_steps=1, report_to=[], disable_tqdm=True, seed=0,
        use_cpu=True, ddp_backend="gloo" if WORLD > 1 else None)
    record = Record(die)
    trainer = GockptTrainer(model=tiny_model(), args=args, train_dataset=dataset(),
                            callbacks=[record],
                            gockpt_options={"overlap_steps": 2, "block_bytes": 4096})
    record.trainer = trainer
    trainer.train(resume_from_checkpoint="resume" in flags)
    if trainer.args.process_index == 0:
        torch.save({"losses": record.losses, "state": trainer.model.state_dict()}, out)
    print(f"rank {trainer.args.process_index}: done at step {trainer.state.global_step}",
          flush=True)


if __name__ == "__main__":
    main()
