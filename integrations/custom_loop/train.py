"""A plain PyTorch training loop with gockpt checkpoints: copy it, replace the model and the data.

    python train.py                     # trains, checkpoints every --every steps
    python train.py --crash-at 130      # dies abruptly after step 130 (os._exit: no cleanup)
    python train.py                     # resumes from the newest committed checkpoint

It trains a tiny GPT-like model with AdamW (decay / no-decay groups, betas (0.9, 0.95)), a
linear warmup then cosine LR schedule and gradient clipping.  The lines marked "gockpt" are
all gockpt needs: a Checkpointer with an interval, its three hooks in the loop, ``close()`` at
the end, and ``gockpt.load`` to resume.  A resumed run continues bit for bit like one that
never stopped (weights, AdamW moments, LR schedule and the RNG states dropout draws from are
all in the checkpoint); ``--record FILE`` writes the losses and a digest of the final state
to compare runs.
"""

import argparse
import hashlib
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import gockpt                                                       # gockpt


# ---------------------------------------------------------------------- the model and data

class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq_len, dropout=0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        """Next-token loss of a (batch, seq_len + 1) batch of tokens."""
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(step, args):
    """The tokens of ``step``, from a generator seeded by it alone: the data position is the
    step, so a resumed run reads what an uninterrupted one would."""
    g = torch.Generator().manual_seed(1_000_003 * step)
    rows = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
    follow = torch.rand(args.batch_size, args.seq_len + 1, generator=g) < 0.9
    for i in range(1, args.seq_len + 1):  # mostly a fixed rule the model can learn
        rows[:, i] = torch.where(follow[:, i], (rows[:, i - 1] * 7 + 3) % args.vocab, rows[:, i])
    return rows


def warmup_cosine(warmup, total, floor=0.1):
    def factor(s):  # s: updates done so far
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def state_digest(model, optimizer, scheduler):
    """sha256 of the training state: weights, AdamW moments and steps, the LR schedule."""
    h = hashlib.sha256(json.dumps(scheduler.state_dict(), default=str).encode())
    tensors = list(model.state_dict().items())
    for i, (p, st) in enumerate(optimizer.state.items()):
        tensors += [(f"{i}/{k}", v) for k, v in sorted(st.items())]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------- training

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-dir", default="checkpoints/tiny-gpt")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--every", type=int, default=50, help="checkpoint interval (steps)")
    ap.add_argument("--mode", default="gockpt-o", choices=sorted(gockpt.MODES))
    ap.add_argument("--overlap-steps", type=int, default=None,
                    help="K: steps a checkpoint's copy spans (default: chosen by gockpt)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--crash-at", type=int, default=None, help="os._exit after this step")
    ap.add_argument("--record", default=None, help="write losses and a state digest here")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.seq_len)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  warmup_cosine(args.warmup, args.steps))

    # gockpt: resume from the newest committed checkpoint, if there is one.  It restores the
    # model, the optimizer, the scheduler and the RNG states (torch, numpy, Python).
    start = 0
    try:
        restored = gockpt.load(args.save_dir, model, optimizer, scheduler=scheduler)
        start = restored.extra_state["data_pos"]
        print(f"resumed from {restored.path}: step {restored.step}, data position {start}")
    except gockpt.CheckpointNotFoundError:
        print(f"no checkpoint in {args.save_dir}: training from step 0")

    ck = gockpt.Checkpointer(model, optimizer, args.save_dir, mode=args.mode,  # gockpt
                             overlap_steps=args.overlap_steps, scheduler=scheduler,
                             interval=args.every, keep_last=3)
    losses = {}
    model.train()
    for step in range(start + 1, args.steps + 1):   # step: the update this iteration makes
        loss = model(batch(step, args))
        ck.backward_begin()                          # gockpt: gradients are about to change
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ck.update_begin()                            # gockpt: the optimizer step comes next
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        # gockpt: the step boundary; every --every steps a checkpoint of this step starts
        # (its copies overlap the next steps' forward/backward) and a handle comes back.
        handle = ck.save_checkpoint(step, extra_state={"data_pos": step})
        if handle is not None:
            print(f"step {step}: loss {loss.item():.4f}, checkpoint of step {step} started")
        if step == args.crash_at:
            print(f"step {step}: crashing (os._exit, no cleanup)", flush=True)
            os._exit(3)
    ck.close()  # gockpt: waits until every started checkpoint is durable
    print(f"trained steps {start + 1}..{args.steps}; final loss {losses.get(args.steps, 'n/a')}")
    if args.record:
        with open(args.record, "w") as f:
            json.dump({"start": start, "losses": losses,
                       "digest": state_digest(model, optimizer, scheduler)}, f)


if __name__ == "__main__":
    main()
