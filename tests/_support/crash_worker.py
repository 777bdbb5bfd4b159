"""Subprocess of test_faults: resumes from the latest checkpoint if there is one (checking it
is complete and bitwise-verified), then trains with a checkpoint every other step until it is
killed. Prints 'resumed <step>' and 'step <n>' lines, flushed."""

import sys

import torch

import gockpt
from gockpt import storage


def main():
    directory = sys.argv[1]
    torch.manual_seed(0)
    # ~4M parameters: 48 MB of state per checkpoint, so persisting takes a while
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    try:
        storage.resolve(directory)
        have = True
    except gockpt.CheckpointNotFoundError:
        have = False
    if have:
        restored = gockpt.load(directory, model, opt, verify=True)
        start = restored.step
        # the checkpoint is whole: the state matches what a checkpoint of that step holds
        assert restored.extra_state == {"step": start}, restored.extra_state
    print(f"resumed {start}", flush=True)
    if sys.argv[2:] == ["--check-only"]:
        return
    ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=2, self_check=0.0)
    x = torch.randn(16, 1024)
    for step in range(start, start + 10_000):
        loss = model(x).pow(2).mean()
        ck.backward_begin(); loss.backward(); ck.update_begin()
        opt.step(); opt.zero_grad()
        ck.save_checkpoint(step + 1, extra_state={"step": step + 1})
        print(f"step {step + 1}", flush=True)


if __name__ == "__main__":
    main()
