"""kill -9 at random instants, and an immediate restart, with the memory tier: every restart must
resume at a state of the uninterrupted run, bit for bit, and the run must end at its final state.

    python experiments/kill_memory_tier.py [--kills 20] [--ranks 1|2] [--steps 300] [--seed 0]

A small model trains ``--steps`` steps with gockpt-o (K=2, a checkpoint every 5 steps), the
memory tier and its step log on (on 2 ranks, DDP: each rank's own log). Its processes are
killed with SIGKILL at random instants -- inside checkpoint windows, while a log entry or a
memory copy is written, during a restart's load and replay -- and started again at once,
``--kills`` times; then the last run trains to the end. Each process reports the step it
resumed at and a digest of its whole state there (parameters, optimizer state, scheduler,
RNG); each must be the uninterrupted run's at that step (computed first, by the same script
without kills). Printed: every kill, where each restart resumed, the steps lost per kill (the
step reached before it, minus the step resumed at), and the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(args) -> None:
    """One rank: resume from ``--dir`` if it holds a checkpoint, train to ``--steps``."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import gockpt
    from gockpt.core.digest import digests, to_hex, as_pairs
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if several else 0
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 64))
    if several:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.9)

    def state_digest() -> str:
        tensors = [t.detach() for t in model.state_dict().values()]
        for st in opt.state.values():
            tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
        tensors.append(torch.get_rng_state())
        pairs = as_pairs(digests([t.contiguous() for t in tensors]))
        return "".join(map(to_hex, pairs)) + json.dumps(sched.state_dict(), sort_keys=True)

    def say(**fields):  # (rank 0's reports: another rank's would fill its pipe unread)
        if rank == 0:
            print(json.dumps(dict(rank=rank, **fields)), flush=True)

    first = 1
    if args.reference:
        ck = None
    else:
        ck = gockpt.Checkpointer(model, opt, args.dir, mode="gockpt-o", overlap_steps=2,
                                 interval=5, scheduler=sched, memory="auto",
                                 memory_dir=args.memory_dir, memory_log=1 << 28)
        try:
            restored = gockpt.load(args.dir, model, opt, scheduler=sched,
                                   memory_dir=args.memory_dir)
        except gockpt.CheckpointNotFoundError:
            restored = None
        if restored is not None:
            first = restored.step + 1
            say(resumed=restored.step, digest=state_digest(), path=restored.path)
    for step in range(first, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randn(16, 64, generator=g)).square().mean()
        if ck is not None:
            ck.backward_begin()
        loss.backward()
        if ck is not None:
            ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        if ck is not None:
            ck.save_checkpoint(step)
        say(step=step, digest=state_digest() if args.reference else None)
    if ck is not None:
        ck.close()
    say(final=state_digest())
    if several:
        dist.destroy_process_group()


def start(args, directory: str, reference: bool = False) -> list:
    port = _free_port()
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dir", directory,
               "--steps", str(args.steps), "--memory-dir", args.memory_dir] + \
            (["--reference"] if reference else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL if rank else subprocess.PIPE,
                                      text=True))
    return procs


def lines(proc) -> list:
    out, _ = proc.communicate()
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def _follow(procs, rng, args, reached) -> list:
    """Rank 0's reports until a random instant, then SIGKILL to every rank: one time in five
    while the processes start (import, load, replay), else a random fraction of a step after
    one of the next 15 steps. Returns rank 0's reports."""
    out = []
    if rng.random() < 0.2:
        time.sleep(rng.uniform(0.2, 2.5))
    else:
        target = min(reached + rng.randint(1, 15), args.steps - 1)
        for line in procs[0].stdout:
            if line.startswith("{"):
                out.append(json.loads(line))
                if out[-1].get("step") == target:
                    time.sleep(rng.uniform(0.0, 0.01))
                    break
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    rest = [lines(p) for p in procs]
    return out + rest[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from gockpt.core.paths import real_directory
    from gockpt.storage import memory_tier
    rng = random.Random(args.seed)
    parent = tempfile.mkdtemp(prefix="gockpt-kill-memory-")
    run = real_directory(os.path.join(parent, "run"))
    try:
        procs = start(args, os.path.join(parent, "reference"), reference=True)
        reference = {}
        for p in procs:
            for x in lines(p):
                if x["rank"] == 0 and "step" in x:
                    reference[x["step"]] = x["digest"]
        procs = start(args, run)
        kills, lost, bad, reached = 0, [], [], 0
        while True:
            out = _follow(procs, rng, args, reached) if kills < args.kills else \
                [lines(p) for p in procs][0]
            steps = [x["step"] for x in out if "step" in x]
            for x in (x for x in out if "resumed" in x):
                ok = reference.get(x["resumed"]) == x["digest"]
                where = "the step log" if "/log/" in x["path"] else \
                    "memory" if x["path"].startswith(args.memory_dir) else "disk"
                print(f"  resumed at step {x['resumed']:>3} from {where} "
                      f"({'bitwise' if ok else 'DIFFERS'})")
                lost.append(reached - x["resumed"])
                if not ok:
                    bad.append(x["resumed"])
            if steps:
                reached = max(steps)
            final = [x for x in out if "final" in x]
            if final:
                ok = final[0]["final"] == reference[args.steps]
                print(f"  the run ended at step {args.steps} ({'bitwise' if ok else 'DIFFERS'})")
                if not ok:
                    bad.append(args.steps)
                break
            kills += 1
            print(f"kill {kills}: after step {reached}" if steps else
                  f"kill {kills}: while starting (loading, replaying)")
            procs = start(args, run)
        print(f"\n{kills} kills on {args.ranks} rank(s), {args.steps} steps, a checkpoint every 5 "
              "(memory tier + step log): steps lost per "
              f"restart {lost} (mean {sum(lost) / max(1, len(lost)):.1f}); "
              f"{'every state bitwise' if not bad else f'DIFFERENT at steps {bad}'}")
        return 1 if bad else 0
    finally:
        memory_tier.remove(run, args.memory_dir)
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
