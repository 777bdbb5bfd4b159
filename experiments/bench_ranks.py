"""Many ranks: what one rank pays for a checkpoint of a replicated (DDP) state on N = 1, 2, 4
ranks of the same model, side by side in one run.

Every N runs the same training (a DistributedDataParallel MLP of ``--params`` parameters,
AdamW, gloo on this machine's CPU, one process per rank as torchrun starts them) with a
gockpt checkpoint every ``--interval`` steps, and reads back ``metrics.jsonl`` (one record per
rank and checkpoint). Printed per N, the median over the checkpoints of the slowest rank (and,
in brackets, the mean over ranks where it differs):

* copied: state bytes one rank copies off the training tensors (replayed + at F);
* host: host memory one rank holds for staging (state copy + gradient buffers);
* written: the size of one rank's data file;
* blocked: training time one checkpoint costs the slowest rank (its hooks);
* durable: from the checkpoint's first step to its commit on every rank.

With N replicas each rank moves S/N: the bytes drop as 1/N; on a GPU node that also means fewer
overlapped steps K for the same link. On this 2-core machine N ranks also share the cores,
so the times here mix the smaller share with N processes competing for 2 cores: read the
bytes as what the design guarantees and the times as this machine's, not a GPU node's.

    python experiments/bench_ranks.py [--params 4e6] [--steps 24] [--interval 6] [--ranks 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(directory: str, params: float, steps: int, interval: int, mode: str) -> None:
    """One rank (RANK/WORLD_SIZE/MASTER_* in the environment)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import gockpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    width = max(64, int((params / 4) ** 0.5))  # four square layers
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ck = gockpt.Checkpointer(ddp, opt, directory, mode=mode, interval=interval)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        loss = ddp(torch.randn(8, width, generator=gen)).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)
    ck.close()
    dist.destroy_process_group()


def run(n: int, args) -> list:
    """Train on ``n`` ranks; the metrics records."""
    directory = tempfile.mkdtemp(prefix=f"bench-ranks-{n}-", dir=args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=ROOT + os.pathsep
                   + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", directory, "--params", str(args.params),
             "--steps", str(args.steps), "--interval", str(args.interval), "--mode", args.mode],
            env=env))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a rank of the N={n} run failed")
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(records: list) -> dict:
    """Per measure: (median over checkpoints of the max over ranks, of the mean over ranks)."""
    by_ckpt: dict = {}
    for r in records:
        by_ckpt.setdefault(r["final_step"], []).append(r)
    measures = {
        "copied": lambda r: r["replayed_bytes"] + r["copied_at_f_bytes"],
        "host": lambda r: r["host_bytes"], "written": lambda r: r["written_bytes"],
        "blocked": lambda r: r["blocked_s"], "durable": lambda r: r["time_to_durable_s"],
        "K": lambda r: r["overlap_steps"]}
    return {name: (statistics.median(max(f(r) for r in rs) for rs in by_ckpt.values()),
                   statistics.median(statistics.mean(f(r) for r in rs)
                                     for rs in by_ckpt.values()))
            for name, f in measures.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=4e6)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--interval", type=int, default=6)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mode", default="gockpt-o")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: /tmp)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.params, args.steps, args.interval, args.mode)
    rows = {n: summarise(run(n, args)) for n in args.ranks}
    s_bytes = rows[args.ranks[0]]["copied"][0] * args.ranks[0]
    print(f"\nbench_ranks: {args.mode}, DDP MLP of {args.params:.3g} parameters "
          f"(state S = {s_bytes / 2**20:.1f} MiB), checkpoint every {args.interval} steps, "
          f"{args.steps} steps; per rank, median over checkpoints of the slowest rank "
          f"[mean over ranks]\n")
    head = f"{'N':>3}  {'copied MiB':>12}  {'x S/N':>6}  {'host MiB':>10}  {'written MiB':>12}  " \
           f"{'K':>3}  {'blocked ms':>16}  {'durable s':>16}"
    print(head)
    for n, r in rows.items():
        def both(name, scale, fmt):
            mx, mean = r[name]
            return f"{mx * scale:{fmt}} [{mean * scale:{fmt}}]"
        print(f"{n:>3}  {r['copied'][0] / 2**20:>12.2f}  {r['copied'][0] / (s_bytes / n):>6.3f}  "
              f"{r['host'][0] / 2**20:>10.2f}  {r['written'][0] / 2**20:>12.2f}  "
              f"{r['K'][0]:>3.0f}  {both('blocked', 1e3, '7.1f'):>16}  "
              f"{both('durable', 1, '7.3f'):>16}")


if __name__ == "__main__":
    main()
