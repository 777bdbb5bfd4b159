"""A torchtitan-style loop that checkpoints through torch.distributed.checkpoint (DCP), in
gockpt's format: copy it, replace the model and the data.

    python train.py                                  # one process
    torchrun --nproc_per_node 2 train.py             # FSDP2 on 2 ranks (gloo on the CPU)
    python train.py --crash-at 13                    # killed (SIGKILL) after step 13
    python train.py                                  # resumes from the newest committed checkpoint

It trains a small residual MLP (on several ranks each block and the root sharded by FSDP2's
``fully_shard``) with AdamW, a warmup LR schedule and gradient clipping, and every ``--every``
steps hands its state dict to ``dcp.async_save`` with gockpt's ``GockptWriter``; at start, when
``--save-dir`` holds a checkpoint, ``dcp.load`` with gockpt's ``GockptReader`` puts it back. The
lines marked "gockpt" are all gockpt needs: the rest is how a DCP loop checkpoints anyway. The
checkpoints are gockpt's: ``gockpt verify``, ``gockpt list`` and ``gockpt.load`` take them, on
any number of ranks. ``--record FILE`` writes the losses and a digest of this rank's final
state (``{rank}`` in FILE is replaced by the rank), to compare runs bit for bit.
"""

import argparse
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gockpt import CheckpointNotFoundError                               # gockpt
from gockpt.storage import resolve                                       # gockpt
from gockpt.storage.dcp import GockptReader, GockptWriter                # gockpt


class ResidualMLP(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                          nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def batch(step, rank, device):
    """This rank's batch of ``step``: a function of both alone (the data position is the step)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(16, 16, generator=g)
    return x.to(device), x.sin().sum(dim=1, keepdim=True).to(device)


def digest(model, optimizer):
    """sha256 of this rank's training state (its shards, under FSDP2)."""
    h = hashlib.sha256()
    tensors = list(model.state_dict().items())
    for i, st in enumerate(optimizer.state.values()):
        tensors += [(f"{i}/{k}", v) for k, v in sorted(st.items())]
    for name, t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-dir", default="checkpoints/dcp-run")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval (steps)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--crash-at", type=int, default=None, help="SIGKILL after this step")
    ap.add_argument("--record", default=None, help="write losses and a state digest here")
    args = ap.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # (FSDP2 and NCCL take the current device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = ResidualMLP(args.dim, args.depth).to(device)
    if world > 1:  # FSDP2: each block its own unit, then the root
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    # the async saves' collectives run on a thread of their own beside training's: on several
    # ranks they need a process group of their own (as torchtitan makes one)
    save_group = dist.new_group(backend="gloo") if world > 1 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8))

    def state(step):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd,
                "lr_scheduler": scheduler.state_dict(), "train_state": {"step": step}}

    start = 0
    try:                                                                 # gockpt
        reader = GockptReader(resolve(args.save_dir))                    # gockpt
    except CheckpointNotFoundError:                                      # gockpt
        print(f"no checkpoint in {args.save_dir}: training from step 0")
    else:
        loaded = state(0)
        dcp.load(loaded, storage_reader=reader)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])
        scheduler.load_state_dict(loaded["lr_scheduler"])
        start = loaded["train_state"]["step"]
        print(f"resumed from {reader.path}: step {start}")

    saving, losses = None, {}
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step % args.every == 0:
            if saving is not None:
                saving.result()  # (the previous save done before the next: as torchtitan)
            saving = dcp.async_save(state(step), process_group=save_group,
                                    storage_writer=GockptWriter(                   # gockpt
                                        args.save_dir, step=step, keep_last=3))    # gockpt
            print(f"step {step}: loss {loss.item():.4f}, checkpoint of step {step} started")
        if step == args.crash_at:
            print(f"step {step}: crashing (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if saving is not None:
        saving.result()
    print(f"trained steps {start + 1}..{args.steps}")
    if args.record:
        with open(args.record.replace("{rank}", str(rank)), "w") as f:
            json.dump({"start": start, "losses": losses, "digest": digest(model, optimizer)}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
