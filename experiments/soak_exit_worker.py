"""One rank of experiments/soak_exit.py (under torchrun), ending as a user's script ends: no
os._exit, the interpreter's own shutdown.

    save DIR [--no-gockpt]   DDP on the demo's model (width 64, depth 2): 10 steps, gockpt-o
                             K=3 with interval=5, close(), destroy_process_group()
    load DIR [--no-gockpt]   FSDP2 loads DIR's latest checkpoint (saved on 2 ranks: resharded),
                             trains one step, destroy_process_group()

--no-gockpt runs the same job without gockpt (save: no checkpoints; load: the state dict by
torch.distributed.checkpoint from DIR/dcp, written there by the first run): where a run aborts,
whether torch alone does too."""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gockpt  # noqa: E402
from model import ModelConfig, batch, build  # noqa: E402

CONFIG = ModelConfig(dim=64, layers=2, hidden=176)
STEPS, EVERY = 10, 5


def loss_of(net, step: int):
    tokens = batch(step, cfg=CONFIG)
    logits = net(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             tokens[:, 1:].reshape(-1))


def save(directory: str, with_gockpt: bool) -> None:
    model, opt, sched = build(CONFIG, total_steps=STEPS)
    net = torch.nn.parallel.DistributedDataParallel(model)
    ck = gockpt.Checkpointer(net, opt, directory, mode="gockpt-o", overlap_steps=3,
                             interval=EVERY, scheduler=sched) if with_gockpt else None
    for step in range(STEPS):
        loss = loss_of(net, step)
        if ck:
            ck.backward_begin()
        loss.backward()
        if ck:
            ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        if ck:
            ck.save_checkpoint(step + 1)
    if ck:
        ck.close()
    elif not os.path.exists(os.path.join(directory, "dcp", ".metadata")):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(directory, "dcp"))


def load(directory: str, with_gockpt: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    model, _, _ = build(CONFIG, total_steps=STEPS)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # the saving run's parameter groups and hyperparameters, over the sharded parameters
    opt = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    if with_gockpt:
        gockpt.load(directory, model, opt)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    loss_of(model, STEPS).backward()
    opt.step()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("save", "load"))
    ap.add_argument("directory")
    ap.add_argument("--no-gockpt", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    (save if args.what == "save" else load)(args.directory, not args.no_gockpt)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ.get('RANK')}: ok",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
