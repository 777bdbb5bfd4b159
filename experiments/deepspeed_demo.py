"""gockpt in a DeepSpeed script: two added lines, then engine.save_checkpoint returns at once.

    python experiments/deepspeed_demo.py           # save, resume in a fresh engine, compare
    python experiments/deepspeed_demo.py --bench   # blocked time: native save vs gockpt's

The script below is an ordinary DeepSpeed loop (bf16, ZeRO stage 1, gradient clipping, the CPU
accelerator here); the lines marked "gockpt" are all it takes.  It trains, checkpoints at step
``--save-at``, and a fresh engine resumed from that checkpoint must then produce exactly the
losses of the uninterrupted run.  ``--bench`` trains a larger model and times, side by side,
how long each checkpoint stopped training: DeepSpeed's own ``save_checkpoint`` against the
patched one (the call, plus what the next step lost waiting for the copy).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

os.environ.update({k: v for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29561"),
                                      ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"))
                   if k not in os.environ})
warnings.filterwarnings("ignore")


MODE = "gockpt-o"  # the state copied over K steps, the optimizer steps between replayed


def make_engine(dim: int, layers: int):
    import deepspeed
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
              for _ in range(layers)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(dim, 8))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "gockpt": {"mode": MODE},               # gockpt options (optional)
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def train_step(engine, step: int, dim: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, dim, generator=g).bfloat16(), torch.randn(8, 8, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def demo(args, work: str) -> bool:
    from gockpt.integrations import deepspeed as gockpt_ds
    reference = make_engine(args.dim, args.layers)          # uninterrupted, no gockpt
    ref_losses = [train_step(reference, s, args.dim) for s in range(1, args.steps + 1)]

    gockpt_ds.install(overlap_steps=3, block_bytes=4096)  # gockpt (K=3: the model is tiny)
    engine = make_engine(args.dim, args.layers)
    for step in range(1, args.save_at + 3):
        train_step(engine, step, args.dim)
        if step == args.save_at:
            # Returns at once. The checkpoint holds step F = save_at + K - 1, reached two
            # steps later: client_state is a callable, called at F.
            engine.save_checkpoint(work, client_state=lambda: {"next": engine.global_steps + 1})
    gockpt_ds.wait(engine)       # only because we resume right away; exit waits by itself
    print(f"checkpoint started at step {args.save_at}, committed: "
          f"{sorted(n for n in os.listdir(work) if n.startswith('step-'))}")

    fresh = make_engine(args.dim, args.layers)
    path, client = fresh.load_checkpoint(work)                   # the unchanged DeepSpeed call
    loaded_at = fresh.global_steps
    resumed = [train_step(fresh, s, args.dim) for s in range(client["next"], args.steps + 1)]
    same = resumed == ref_losses[client["next"] - 1:]
    print(f"resumed from {os.path.basename(path)} (global_steps {loaded_at}): "
          f"{len(resumed)} losses {'bitwise equal to' if same else 'DIFFERENT from'} the "
          "uninterrupted run")
    return same and len(resumed) > 0


def bench(args, work: str) -> None:
    from gockpt.integrations import deepspeed as gockpt_ds
    results = {}
    # gockpt: its defaults (on the CPU the replayed gradients cross in fp32); gockpt-bf16:
    # the bf16 gradient transport (the default on a GPU), side by side
    for name in ("native", "gockpt", "gockpt-bf16"):
        if name != "native":
            gockpt_ds.install(**({"grad_transport": "bf16"} if name == "gockpt-bf16" else {}))
        engine = make_engine(args.dim, args.layers)
        times, stalls = [], []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            train_step(engine, step, args.dim)
            times.append(time.perf_counter() - t0)
            if step % args.every == 0:
                t0 = time.perf_counter()
                engine.save_checkpoint(os.path.join(work, name))
                stalls.append([time.perf_counter() - t0, step])
        for stall in stalls:  # + what the next step took beyond the median step
            nxt = stall[1]  # times[nxt] is step nxt + 1
            if nxt < len(times):
                stall[0] += max(0.0, times[nxt] - statistics.median(times))
        gockpt_ds.wait()
        gockpt_ds.uninstall()
        results[name] = statistics.median(s for s, _ in stalls)
        print(name, [round(s * 1e3, 1) for s, _ in stalls], "ms; median step", round(statistics.median(times) * 1e3, 1), "ms")
    params = sum(p.numel() for p in make_engine(args.dim, args.layers).module.parameters())
    print(f"{params / 1e6:.1f}M params, {params * 12 / 1e6:.0f} MB of fp32 state, a checkpoint "
          f"every {args.every} steps, {args.steps} steps")
    import gockpt
    native = results["native"]
    for name in ("gockpt", "gockpt-bf16"):
        recs = [r for r in gockpt.metrics.read(os.path.join(work, name)) if r["grad_steps"]]
        crossed = ""
        if recs:  # the replay modes: what the gradients of the steps in between cost the link
            per_step = statistics.median(r["grad_bytes_per_step"] for r in recs)
            kinds = "/".join(sorted({r["grad_transport"] for r in recs}))
            crossed = f"; replayed gradients: {kinds}, {per_step / 1e6:.1f} MB per step"
        print(f"blocked per checkpoint: {name} {results[name] * 1e3:.1f} ms = "
              f"{results[name] / native:.3f}x native's {native * 1e3:.1f} ms{crossed}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", action="store_true", help="time native vs gockpt saves")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--save-at", type=int, default=20)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)
    args.dim = args.dim or (1024 if args.bench else 32)
    args.layers = args.layers or (4 if args.bench else 2)
    args.steps = args.steps or (40 if args.bench else 24)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    work = tempfile.mkdtemp(prefix="gockpt-ds-demo-")
    try:
        if args.bench:
            bench(args, work)
            return 0
        return 0 if demo(args, work) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
