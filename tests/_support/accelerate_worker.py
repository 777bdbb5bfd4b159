"""One rank of tests/integrations/test_transformers.py's Accelerate runs: ``python -m
tests._support.accelerate_worker RUN_DIR OUT [die:STEP]`` trains a small model with dropout
in a loop of its own prepared by Accelerate (a shuffled loader, AdamW, a per-step schedule,
Accelerate's gradient clipping) and gockpt's hooks on the torch optimizer inside
Accelerate's wrapper, as docs/transformers.md shows; it resumes from RUN_DIR's newest
checkpoint when there is one (``gockpt.load`` after ``prepare``, the data position from the
step it restored, ``skip_first_batches``), and is killed with SIGKILL after the optimizer step
``die:STEP`` once the checkpoints so far are durable; rank 0 writes each step's loss and the
final state to OUT. Several ranks (RANK / WORLD_SIZE set, as torchrun's): DDP over gloo."""

import os
import signal
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration

import gockpt

EPOCHS, EVERY = 3, 3


def main():
    run, out, *flags = sys.argv[1:]
    die = next((int(f.split(":")[1]) for f in flags if f.startswith("die:")), None)
    torch.set_num_threads(1)  # (the same arithmetic however busy the cores: runs compared)
    if "RANK" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    # a seedable sampler: each epoch's order from the seed and the epoch alone, as a resume needs
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                          torch.randn(64, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    step = 0
    try:
        step = gockpt.load(run, model, opt.optimizer, scheduler=sched.scheduler).step
    except gockpt.CheckpointNotFoundError:
        pass
    ck = gockpt.Checkpointer(model, opt.optimizer, run, scheduler=sched.scheduler,
                             interval=EVERY, overlap_steps=2)
    losses, per_epoch = [], len(loader)
    for epoch in range(step // per_epoch, EPOCHS):
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, step % per_epoch) \
            if epoch == step // per_epoch else loader
        for x, y in batches:
            ck.backward_begin()
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            ck.update_begin()
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            losses.append((step, accelerator.gather(loss.detach()).mean().item()))
            ck.save_checkpoint(step)
            if step == die:
                ck.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    if accelerator.is_main_process:
        torch.save({"losses": losses, "state": accelerator.unwrap_model(model).state_dict()},
                   out)


if __name__ == "__main__":
    main()
