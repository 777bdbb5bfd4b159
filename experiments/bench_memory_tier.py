"""Restarting after a crash, from the memory tier and from disk, side by side in one run.

    python experiments/bench_memory_tier.py [--gb 1] [--repeat 3] [--dir D] [--memory-dir /dev/shm]

A process trains a model whose checkpoint is about ``--gb`` GB (fp32 weights and AdamW's two
moments: 12 bytes a parameter) with ``Config(memory="auto")``, checkpoints once and is killed
with SIGKILL (its memory copy stays, as after any crash). Then fresh processes restart from
that checkpoint, each timed from its start (``python`` launched) to the end of its first
training step after the load, ``--repeat`` times each, the best reported:

* memory     the memory tier's copy (checked completely, then loaded from tmpfs)
* disk warm  the disk's checkpoint, its file in the page cache (just written)
* disk cold  the disk's checkpoint, its file dropped from the page cache first
             (posix_fadvise DONTNEED: the disk is the limit)

Every restart's state is compared bitwise with the killed process's at its checkpoint. The
restart's own parts (interpreter and torch start, building the model, the load, the step) are
printed apart. What is lost per failure is not measured here: without the step log (#39 item
2, not built yet) a restart from memory resumes at the same checkpoint as one from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDTH = 2048  # Linear(WIDTH, WIDTH) layers: 4.2M parameters, 50 MB of checkpoint each


def layers_for(gb: float) -> int:
    return max(1, round(gb * 1e9 / (12 * (WIDTH * WIDTH + WIDTH))))


def child(args) -> None:
    """One process: train and get killed (``--role train``), or restart and time it."""
    t_start = float(args.t0)
    import torch

    import gockpt
    from gockpt.testing import snapshot
    t_import = time.time()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    t_built = time.time()
    if args.role == "train":
        ck = gockpt.Checkpointer(model, opt, args.dir, mode="gockpt-o", overlap_steps=1,
                                 interval=2, memory="auto", memory_dir=args.memory_dir)
        for s in (1, 2):
            ck.backward_begin()
            model(x).square().mean().backward()
            ck.update_begin()
            opt.step()
            opt.zero_grad()
            ck.save_checkpoint(s)
        ck.wait()
        torch.save(snapshot(model, opt), os.path.join(args.dir, "expected.pt"))
        os.kill(os.getpid(), signal.SIGKILL)
    restored = gockpt.load(args.dir, model, opt, memory_dir=args.memory_dir)
    t_loaded = time.time()
    same = gockpt.testing.first_difference(
        snapshot(model, opt), torch.load(os.path.join(args.dir, "expected.pt"),
                                         weights_only=False)) is None
    t_checked = time.time()
    step()
    t_step = time.time()
    print(json.dumps({"path": restored.path, "bitwise": same,
                      "start": t_import - t_start, "build": t_built - t_import,
                      "load": t_loaded - t_built, "step": t_step - t_checked,
                      "total": t_step - t_start - (t_checked - t_loaded)}))


def drop_cache(directory: str) -> None:
    """Drop the page cache of every file under ``directory``."""
    for base, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(base, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_child(role: str, layers: int, directory: str, memory_dir: str):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--layers", str(layers),
           "--dir", directory, "--memory-dir", memory_dir, "--t0", repr(time.time())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if role == "train":
        if proc.returncode != -signal.SIGKILL:
            raise SystemExit(f"the training process did not end as killed: {proc.stderr}")
        return None
    if proc.returncode != 0:
        raise SystemExit(f"restart failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="the run directory's parent (default: a temporary one)")
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t0", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role is not None:
        child(args)
        return 0
    from gockpt.core.paths import real_directory
    from gockpt.storage import memory_tier
    layers = layers_for(args.gb)
    parent = tempfile.mkdtemp(prefix="gockpt-bench-memory-", dir=args.dir)
    run = real_directory(os.path.join(parent, "run"))
    nowhere = tempfile.mkdtemp(prefix="gockpt-bench-no-memory-", dir=args.memory_dir)
    try:
        t0 = time.time()
        run_child("train", layers, run, args.memory_dir)
        print(f"state: {layers} x Linear({WIDTH}, {WIDTH}), "
              f"{layers * (WIDTH * WIDTH + WIDTH) * 12 / 1e9:.2f} GB of checkpoint; trained, "
              f"checkpointed and killed in {time.time() - t0:.1f} s")
        where = {"memory": args.memory_dir, "disk warm": nowhere, "disk cold": nowhere}
        best = {}
        for _ in range(args.repeat):
            for name, memory_dir in where.items():
                if name == "disk cold":
                    drop_cache(run)
                r = run_child("restart", layers, run, memory_dir)
                expect_memory = name == "memory"
                if r["path"].startswith(memory_tier.root_of(run, args.memory_dir)) != expect_memory:
                    raise SystemExit(f"{name}: loaded {r['path']}")
                if not r["bitwise"]:
                    raise SystemExit(f"{name}: the restarted state differs from the killed one")
                if name not in best or r["total"] < best[name]["total"]:
                    best[name] = r
        print(f"{'restart from':<12} {'start to 1st step':>18} {'interpreter+torch':>18} "
              f"{'build model':>12} {'load':>8} {'1st step':>9}  (s, best of {args.repeat}; "
              "every state bitwise)")
        for name, r in best.items():
            print(f"{name:<12} {r['total']:>18.2f} {r['start']:>18.2f} {r['build']:>12.2f} "
                  f"{r['load']:>8.2f} {r['step']:>9.2f}")
    finally:
        memory_tier.remove(run, args.memory_dir)
        shutil.rmtree(parent, ignore_errors=True)
        shutil.rmtree(nowhere, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
