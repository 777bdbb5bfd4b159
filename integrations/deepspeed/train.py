"""A DeepSpeed training script with gockpt checkpoints: copy it, replace the model and the data.

    python train.py                                    # 1 rank (CPU or one GPU)
    torchrun --nproc_per_node 2 train.py               # 2 ranks
    deepspeed --num_gpus 2 train.py                    # the DeepSpeed launcher

It trains a tiny GPT-like model with the DeepSpeed config next to it (bf16, ZeRO stage 1,
AdamW, gradient clipping, warmup + cosine LR, and a "gockpt" section), saves a checkpoint every
``--save-every`` steps with ``engine.save_checkpoint`` and, when ``--save-dir`` already holds
one, resumes from it with ``engine.load_checkpoint``.  The lines marked "gockpt" are the only
ones gockpt needs; everything else is plain DeepSpeed.

``--crash-at N`` ends the process abruptly after step N (``os._exit``: no cleanup), as a
preemption would; run the same command again and it resumes from the newest committed
checkpoint.  ``--record FILE`` writes the losses and a digest of the final training state (for
comparing runs bit for bit; ``{rank}`` in FILE is replaced by the rank).
"""

import argparse
import hashlib
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


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
        logits = self.head(self.ln(h)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(step, micro, rank, args, batch_size, device):
    """The tokens of (step, micro-batch, rank), from a generator seeded by them alone: the data
    position is the step, so a resumed run reads what an uninterrupted one would."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    rows = torch.randint(0, args.vocab, (batch_size, args.seq_len + 1), generator=g)
    follow = torch.rand(batch_size, args.seq_len + 1, generator=g) < 0.9
    for i in range(1, args.seq_len + 1):  # mostly a fixed rule the model can learn
        rows[:, i] = torch.where(follow[:, i], (rows[:, i - 1] * 7 + 3) % args.vocab, rows[:, i])
    return rows.to(device)


def state_digest(engine):
    """sha256 of this rank's training state: the module's weights, and the fp32 master weights
    and moments the base optimizer holds (this rank's ZeRO partition)."""
    h = hashlib.sha256()
    tensors = list(engine.module.state_dict().items())
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for i, group in enumerate(base.param_groups):
        for j, p in enumerate(group["params"]):
            tensors.append((f"master/{i}/{j}", p))
            tensors += [(f"state/{i}/{j}/{k}", v) for k, v in sorted(base.state[p].items())
                        if torch.is_tensor(v)]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------- training

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "ds_config.json"))
    ap.add_argument("--save-dir", default="checkpoints/ds-tiny-gpt")
    ap.add_argument("--steps", type=int, default=None,
                    help="train up to this step (default: the scheduler's total_num_steps)")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--crash-at", type=int, default=None, help="os._exit after this step")
    ap.add_argument("--record", default=None, help="write losses and a state digest here")
    ap.add_argument("--local_rank", type=int, default=-1, help="(set by the deepspeed launcher)")
    args = ap.parse_args()

    # One process started with plain `python`: a job of one rank.
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)

    import deepspeed
    from gockpt.integrations import deepspeed as gockpt_ds         # gockpt
    gockpt_ds.install()   # gockpt: before deepspeed.initialize; options: the "gockpt" section

    with open(args.config) as f:
        config = json.load(f)
    steps = args.steps or config["scheduler"]["params"]["total_num_steps"]

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.seq_len)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    rank = torch.distributed.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    # Resume if the directory holds a checkpoint (DeepSpeed's own call, unchanged).
    load_path, client_state = engine.load_checkpoint(args.save_dir)
    start = 0
    if load_path is not None:
        start = client_state["data_pos"]
        say(f"resumed from {load_path}: step {engine.global_steps}, data position {start}")
    else:
        say(f"no checkpoint in {args.save_dir}: training from step 0")

    losses = {}
    gas = engine.gradient_accumulation_steps()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    for step in range(start + 1, steps + 1):
        total = 0.0
        for micro in range(gas):
            loss = engine(batch(step, micro, rank, args, micro_batch, engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses[step] = total
        if step % args.save_every == 0:
            # Returns at once: the state of this step is copied while training goes on.
            engine.save_checkpoint(args.save_dir, client_state={"data_pos": step})
            say(f"step {step}: loss {total:.4f}, checkpoint of step {step} started")
        if step == args.crash_at:
            say(f"step {step}: crashing (os._exit, no cleanup)", flush=True)
            os._exit(3)

    gockpt_ds.wait(engine)  # gockpt: every checkpoint durable (it also runs at exit)
    latest = os.path.join(args.save_dir, "latest")
    newest = open(latest).readline().strip() if os.path.exists(latest) else None
    say(f"trained steps {start + 1}..{steps}; newest checkpoint: {newest}")
    if args.record:
        with open(args.record.format(rank=rank), "w") as f:
            json.dump({"start": start, "losses": losses, "digest": state_digest(engine)}, f)


if __name__ == "__main__":
    main()
