"""A small LLaMA-style decoder and a synthetic, deterministic token stream for the gockpt demo.

The model: token embedding -> N x [RMSNorm -> causal multi-head attention with rotary position
embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> untied LM head.
Every parameter is float32 and contiguous (what gockpt's bitwise optimizer replay expects).

The data: ``batch(step)`` builds its tokens from a ``torch.Generator`` seeded by ``step`` alone,
so any process can regenerate the exact batch of any step -- a resumed run sees the same data
as an uninterrupted one without having to checkpoint a data loader. Each sequence mostly
follows one fixed permutation of the vocabulary (next = perm[current] 80% of the time), which a
small model learns within a few hundred steps, so the loss visibly falls.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class ModelConfig:
    vocab: int = 512
    dim: int = 256
    layers: int = 4
    heads: int = 4
    hidden: int = 688          # SwiGLU width, about 8/3 * dim
    seq_len: int = 64
    dropout: float = 0.05      # small, but it consumes the torch RNG: restoring it matters
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, seq_len: int, base: float):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """x: (B, H, T, hd); rotate pairs (x[..., :hd/2], x[..., hd/2:])."""
    t = x.shape[-2]
    cos, sin = cos[:t], sin[:t]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w_down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class TinyLlama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)   # untied
        cos, sin = rotary_tables(cfg.dim // cfg.heads, cfg.seq_len, cfg.rope_base)
        # Derived from the config, not learned: keep them out of the state dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():   # GPT-2 style scaled residual projections
            if name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))

    def loss(self, tokens):
        """Next-token cross entropy on a (B, T + 1) batch."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def build(cfg: ModelConfig | None = None, *, total_steps: int = 300, seed: int = 0,
          lr: float = 2e-3, warmup: int = 20):
    """Model, AdamW (decay / no-decay groups) and a warmup + cosine LambdaLR, all deterministic
    from ``seed``. Seeds torch, numpy and random first."""
    cfg = cfg or ModelConfig()
    seed_all(seed)
    model = TinyLlama(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    return model, opt, sched


_PERM_SEED = 12345


def batch(step: int, batch_size: int = 8, cfg: ModelConfig | None = None) -> torch.Tensor:
    """Tokens (batch_size, seq_len + 1) of ``step``, from a generator seeded by ``step`` alone.

    Each row is a noisy walk along one fixed random permutation of the vocabulary: the next
    token is ``perm[token]`` with probability 0.8, else uniformly random. A model that learns
    the permutation gets the loss from ln(vocab) ~ 6.2 down towards ~1.6.
    """
    cfg = cfg or ModelConfig()
    perm = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(_PERM_SEED))
    g = torch.Generator().manual_seed(1_000_003 * (step + 1))
    n = cfg.seq_len + 1
    noise = torch.randint(0, cfg.vocab, (batch_size, n), generator=g)
    follow = torch.rand(batch_size, n, generator=g) < 0.8
    rows = torch.empty(batch_size, n, dtype=torch.long)
    rows[:, 0] = noise[:, 0]
    for i in range(1, n):
        rows[:, i] = torch.where(follow[:, i], perm[rows[:, i - 1]], noise[:, i])
    return rows


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
