"""gockpt demo: train, crash, resume, verify bit for bit, and measure what checkpointing costs.

Run from the repository root::

    python experiments/demo.py            # full demo (about 2 minutes on 2 CPU cores)
    python experiments/demo.py --quick    # a tiny run of every phase (about 40 seconds)

Phases:

1. **train, then crash** -- a child process trains a small LLaMA-style model with
   ``gockpt.Checkpointer(mode="gockpt-o")``, checkpointing every ``--every`` steps, and kills
   itself with SIGKILL part-way (a real crash: no cleanup, no atexit, nothing flushed by us).
2. **resume and verify** -- this process trains an uninterrupted *reference* run without any
   checkpointer. A fresh child process restores the latest checkpoint with ``gockpt.load``,
   compares model, optimizer, scheduler and RNG state with the reference's state at the same
   step, tensor by tensor and bit for bit, then trains on to ``--steps``; every loss must equal
   the reference's loss exactly.
3. **blocked time** -- a child process trains the same model for a few dozen steps under each
   mode (``sync``, ``async``, ``async-o``, ``gockpt-o``) and without checkpointing, and prints
   how long each checkpoint stopped training.

Exit status 0 only if everything verified. Nothing here is timing-sensitive for correctness:
the bitwise checks hold whatever the machine load; only the numbers of phase 3 vary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):          # `model` from experiments/, `gockpt` from the repo root
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import gockpt  # noqa: E402
from model import ModelConfig, batch, build, num_params  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # the demo works without it
    tqdm = None

MARKER = ".gockpt-demo"          # marks a directory this demo may wipe
BENCH_MODES = ("sync", "async", "async-o", "gockpt-o")
WIDTH = 78


# ----------------------------------------------------------------------------- output helpers

def say(msg: str = "") -> None:
    print(msg, flush=True)


def header(title: str) -> None:
    say()
    say("=" * WIDTH)
    say(f" {title}")
    say("=" * WIDTH)


def section(title: str) -> None:
    say()
    say(f"--- {title} " + "-" * max(3, WIDTH - 5 - len(title)))


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    """tqdm when stderr is a terminal; otherwise (logs, pipes) a plain line every ~10%."""

    def __init__(self, total: int, initial: int, desc: str, lines: bool = True):
        self.total, self.desc, self.lines = total, desc, lines
        self.tty = sys.stderr.isatty()
        self.every = max(1, (total - initial) // 10)
        self.bar = None
        if self.tty and tqdm is not None:
            self.bar = tqdm(total=total, initial=initial, desc=f"  {desc}", unit="step",
                            dynamic_ncols=True, leave=True,
                            bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {postfix} "
                                       "[{elapsed}<{remaining}, {rate_fmt}]")

    def update(self, done: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        elif self.tty:  # no tqdm: one carriage-return line
            sys.stderr.write(f"\r  {self.desc}: step {done}/{self.total}  loss {loss:.3f}  ")
            sys.stderr.flush()
        elif self.lines and (done % self.every == 0 or done == self.total):
            say(f"  {self.desc}: step {done:>4}/{self.total}  loss {loss:.4f}")

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
            sys.stdout.flush()
        else:
            if self.tty:
                sys.stderr.write("\r" + " " * 60 + "\r")
            say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")


class MetricsTail:
    """Reads the lines gockpt appends to ``<dir>/metrics.jsonl`` (one per committed checkpoint)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "metrics.jsonl")
        self.offset = 0

    def new(self):
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind("\n") + 1          # only whole lines
        self.offset += len(data[:end].encode())
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def describe_commit(m: dict) -> str:
    k = m["overlap_steps"]
    span = (f"captured over steps {m['start_step']}..{m['final_step']}" if k > 1
            else f"captured at step {m['final_step']}")
    return (f"  [ckpt] step {m['final_step']:>4} durable   K={k} ({span})  "
            f"training blocked {m['blocked_s'] * 1e3:5.1f} ms  "
            f"durable after {m['time_to_durable_s']:.2f} s")


# ----------------------------------------------------------------------------- training loop

def train_loop(model, opt, sched, start: int, stop: int, *, ck=None, ckpt_due=None,
               kill_at=None, on_kill=None):
    """Yields (step, loss, handle) for steps [start, stop). Step ``s`` consumes batch(s); the
    checkpoint taken after it is named ``s + 1`` (the number of completed steps)."""
    model.train()
    for step in range(start, stop):
        loss = model.loss(batch(step))
        if ck is not None:
            ck.backward_begin()
        loss.backward()
        if kill_at is not None and step == kill_at:
            if on_kill is not None:
                on_kill(step)
            os.kill(os.getpid(), signal.SIGKILL)     # a real crash, mid-step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if ck is not None:
            ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        value = loss.item()
        handle = None
        if ck is not None:
            done = step + 1
            handle = ck.save_checkpoint(
                done, extra_state={"tokens_seen": done * 8 * ModelConfig().seq_len,
                                   "loss": value},
                force=bool(ckpt_due and ckpt_due(done)))
        yield step, value, handle


def snapshot(model, opt, sched) -> dict:
    """Everything a resume must restore, in a form torch.load(weights_only=True) accepts."""
    import numpy as np
    import random
    np_state = np.random.get_state()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(),
                "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")),
                          int(np_state[2]), int(np_state[3]), float(np_state[4])],
                "python": random.getstate()},
    }


def first_difference(a, b, path: str):
    """None if ``a`` and ``b`` are identical bit for bit, else a description of the first
    difference. Floating tensors are compared as raw bytes (so -0.0 != 0.0, NaN == same NaN)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ab, bb):
            n = (a != b).sum().item() if a.numel() else 0
            return f"{path}: {n} of {a.numel()} elements differ"
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))[:6]} vs " \
                   f"{sorted(map(str, b))[:6] if isinstance(b, dict) else type(b).__name__}"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{path}: length/type differs"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if a != b and not (a != a and b != b):
        return f"{path}: {a!r} != {b!r}"
    return None


def count_tensors(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


def read_losses(path: str) -> dict:
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    out[rec["step"]] = rec["loss"]
    return out


def compare_losses(got: dict, ref: dict, steps) -> tuple:
    """(number compared, first mismatch or None)."""
    for s in steps:
        if s not in got or s not in ref or got[s] != ref[s]:
            return s, f"step {s}: {got.get(s)!r} vs reference {ref.get(s)!r}"
    return len(list(steps)), None


# ----------------------------------------------------------------------------- phase: train

def phase_train(args) -> int:
    """Child process of phase 1: train with gockpt-o and crash at --kill-at."""
    model, opt, sched = build(total_steps=args.steps)
    ck = gockpt.Checkpointer(model, opt, args.ckpt_dir, mode="gockpt-o", overlap_steps=args.k,
                             scheduler=sched, interval=args.every)
    tail = MetricsTail(args.ckpt_dir)
    bar = Progress(args.steps, 0, "training (gockpt-o)")
    in_flight = []

    def on_kill(step):
        for m in tail.new():
            bar.write(describe_commit(m))
        pending = [h.final_step for h in in_flight if not h.done()]
        bar.write(f"  !! CRASH: SIGKILL during step {step + 1} of {args.steps} "
                  f"(after backward, before the optimizer step)"
                  + (f"; checkpoint(s) {pending} still in flight are lost" if pending else ""))
        if bar.bar is not None:
            bar.bar.refresh()
        sys.stdout.flush()
        sys.stderr.flush()

    with open(args.losses, "w") as out:
        for step, loss, handle in train_loop(model, opt, sched, 0, args.steps, ck=ck,
                                             kill_at=args.kill_at, on_kill=on_kill):
            out.write(json.dumps({"step": step, "loss": loss}) + "\n")
            out.flush()                      # the parent reads this after the crash
            if handle is not None:
                in_flight.append(handle)
            in_flight = [h for h in in_flight if not h.done()]
            for m in tail.new():
                bar.write(describe_commit(m))
            bar.update(step + 1, loss)
    # Only reached without --kill-at.
    ck.close()
    bar.close()
    return 0


# ----------------------------------------------------------------------------- phase: resume

def phase_resume(args) -> int:
    """Child process of phase 2: gockpt.load, verify against the reference, train on."""
    model, opt, sched = build(total_steps=args.steps)   # fresh objects, fresh RNG
    t0 = time.perf_counter()
    restored = gockpt.load(args.ckpt_dir, model, opt, scheduler=sched)
    load_s = time.perf_counter() - t0
    man = restored.manifest
    start = restored.step
    say(f"  gockpt.load: {os.path.relpath(restored.path)} in {load_s * 1e3:.0f} ms "
        f"(mode {man['mode']}, K={man['overlap_steps']}, checksums verified)")
    say(f"  restored step {start}, extra_state {restored.extra_state}")

    ref = torch.load(args.reference, weights_only=True)
    mine = snapshot(model, opt, sched)
    ok = True
    say(f"  bitwise comparison with the reference run's state after {start} steps:")
    for key, label in (("model", "model.state_dict()"), ("optimizer", "optimizer.state_dict()"),
                       ("scheduler", "scheduler.state_dict()"),
                       ("rng", "RNG states (torch, numpy, random)")):
        diff = first_difference(mine[key], ref[key], key)
        n = count_tensors(ref[key])
        what = f"{n} tensors" if n and key != "rng" else ""
        say(f"    {label:<36} {what:>11}  " + ("identical" if diff is None else f"DIFFERS: {diff}"))
        ok &= diff is None
    if not ok:
        say("  state verification FAILED")
        return 1

    # Train on to the end -- still checkpointing, as a real resumed job would. (A checkpoint is
    # not started at the very last step: with K > 1 it would need steps that never come.)
    ck = gockpt.Checkpointer(model, opt, args.ckpt_dir, mode="gockpt-o", overlap_steps=args.k,
                             scheduler=sched)
    tail = MetricsTail(args.ckpt_dir)
    tail.new()                               # skip the commits of the crashed run
    ref_losses = read_losses(args.reference_losses)
    losses = {}
    bar = Progress(args.steps, start, "resumed run   ")
    due = lambda s: s % args.every == 0 and s < args.steps  # noqa: E731
    for step, loss, _ in train_loop(model, opt, sched, start, args.steps, ck=ck, ckpt_due=due):
        losses[step] = loss
        for m in tail.new():
            bar.write(describe_commit(m))
        bar.update(step + 1, loss)
    ck.close()
    for m in tail.new():
        bar.write(describe_commit(m))
    bar.close()
    with open(args.losses, "w") as f:
        for s, v in sorted(losses.items()):
            f.write(json.dumps({"step": s, "loss": v}) + "\n")
    n, diff = compare_losses(losses, ref_losses, range(start, args.steps))
    if diff is None:
        say(f"  losses of steps {start + 1}..{args.steps} vs the uninterrupted reference: "
            f"{n} of {n} equal")
        say("  bitwise identical: yes")
        return 0
    say(f"  bitwise identical: NO -- first difference at {diff}")
    return 1


# ----------------------------------------------------------------------------- phase: bench

class Stopwatch:
    """Times every gockpt call of one run: the hooks of step ``s`` and ``save_checkpoint`` at
    boundary ``s`` add to ``spent[s]``. Stands in for ``ck`` in train_loop; two optimizer
    pre-hooks bracket gockpt's own pre-hook (where it records gradients)."""

    def __init__(self, opt):
        self.ck, self.spent, self.boundary, self._t = None, {}, 0, None
        # Pre-hooks run in registration order: ours (start), gockpt's, ours (stop).
        opt.register_step_pre_hook(self._pre_start)

    def attach(self, ck, opt):
        """Call right after the Checkpointer (and so its pre-hook) was created."""
        self.ck = ck
        opt.register_step_pre_hook(self._pre_end)

    def _add(self, where, seconds):
        self.spent[where] = self.spent.get(where, 0.0) + seconds

    def _pre_start(self, *_):
        self._t = time.perf_counter()

    def _pre_end(self, *_):
        self._add(self.boundary, time.perf_counter() - self._t)

    def backward_begin(self):
        t = time.perf_counter()
        self.ck.backward_begin()
        self._add(self.boundary, time.perf_counter() - t)

    def update_begin(self):
        t = time.perf_counter()
        self.ck.update_begin()
        self._add(self.boundary, time.perf_counter() - t)

    def save_checkpoint(self, step, **kw):
        t = time.perf_counter()
        handle = self.ck.save_checkpoint(step, **kw)
        self._add(step, time.perf_counter() - t)
        self.boundary = step
        return handle

    def window(self, start, stop):
        return sum(v for k, v in self.spent.items() if start <= k < stop)


def phase_bench(args) -> int:
    """Child process of phase 3: blocked time per checkpoint, every mode on the same model.

    The runs go one after another (running them interleaved would make the background work
    of a checkpoint look faster in wall-clock time than it is); the run without checkpointing
    goes first and last, and its step time is the mean of the two."""
    steps, every = args.bench_steps, args.bench_every
    due = list(range(every, steps - every + 1, every))
    shutil.rmtree(args.bench_dir, ignore_errors=True)
    configs = [("(none)", None, None)] + [(m, m, None) for m in BENCH_MODES] + \
        [("gockpt-o", "gockpt-o", args.bench_k), ("(none)", None, None)]

    # Warm up kernels and the allocator on a throwaway model so the first run is not penalised.
    model, opt, sched = build(total_steps=steps)
    for _ in train_loop(model, opt, sched, 0, 3):
        pass

    runs = []
    bar = Progress(steps * len(configs), 0, f"{len(configs)} runs x {steps} steps", lines=False)
    for label, mode, k in configs:
        model, opt, sched = build(total_steps=steps)
        ck = watch = None
        d = os.path.join(args.bench_dir, f"{mode}-k{k}" if k else str(mode))
        if mode is not None:
            watch = Stopwatch(opt)
            ck = gockpt.Checkpointer(model, opt, d, mode=mode, overlap_steps=k, scheduler=sched)
            watch.attach(ck, opt)
        times = []
        t = time.perf_counter()
        for step, loss, _ in train_loop(model, opt, sched, 0, steps, ck=watch,
                                        ckpt_due=lambda s: s in due):
            now = time.perf_counter()
            times.append(now - t)
            t = now
            bar.update(len(runs) * steps + step + 1, loss)
        if ck is not None:
            ck.close()
        runs.append({"label": label, "mode": mode, "k": k, "dir": d, "watch": watch,
                     "times": times})
        what = "no checkpointing" if mode is None else f"mode={mode!r:<10} overlap_steps={k}"
        bar.write(f"  run {len(runs)}/{len(configs)}  {what:<40} mean step "
                  f"{statistics.mean(times[1:]) * 1e3:6.1f} ms")
    bar.close()

    ok = True
    # step 0 of a fresh model is slower for every run alike: leave it out
    base = statistics.mean(runs[0]["times"][1:] + runs[-1]["times"][1:])
    rows = []
    for r in runs[1:-1]:
        recs = [json.loads(x) for x in open(os.path.join(r["dir"], "metrics.jsonl"))]
        if len(recs) != len(due):
            say(f"  {r['label']}: expected {len(due)} committed checkpoints, got {len(recs)}")
            ok = False
        rows.append({**r, "K": sorted({m["overlap_steps"] for m in recs}),
                     "watch_s": statistics.median(r["watch"].window(n, n + every) for n in due),
                     "lib_s": statistics.median(m["blocked_s"] for m in recs),
                     "durable": statistics.median(m["time_to_durable_s"] for m in recs),
                     "busy": max(m["blocked_by_hook_s"].get("save_checkpoint_busy_wait", 0.0)
                                 for m in recs),
                     "state": recs[0]["state_bytes"],
                     "grad": max(m["grad_bytes"] for m in recs),
                     "step": statistics.mean(r["times"][1:])})
    ref = next(r["watch_s"] for r in rows if r["mode"] == "async")

    say(f"  {steps} steps per run, checkpoints at steps {', '.join(map(str, due))}; "
        f"{mb(rows[0]['state'])} of state per checkpoint")
    say()
    say(f"  {'mode':<9} {'K':>2}  {'blocked/ckpt':>12}  {'vs async':>8}  {'gockpt says':>11}  "
        f"{'durable after':>13}  {'mean step':>9}  {'vs none':>7}")
    say(f"  {'-' * 9} {'-' * 2}  {'-' * 12}  {'-' * 8}  {'-' * 11}  {'-' * 13}  {'-' * 9}  "
        f"{'-' * 7}")
    say(f"  {'(none)':<9} {'-':>2}  {'-':>12}  {'':>8}  {'':>11}  {'-':>13}  "
        f"{base * 1e3:>6.1f} ms  {'1.00x':>7}")
    for r in rows:
        k = ",".join(map(str, r["K"])) + ("" if r["k"] else "*")
        busy = "!" if r["busy"] > 1e-3 else " "
        say(f"  {r['label']:<9} {k:>2}  {r['watch_s'] * 1e3:>9.1f} ms{busy} "
            f"{r['watch_s'] / ref:>7.2f}x  {r['lib_s'] * 1e3:>8.1f} ms  "
            f"{r['durable']:>11.2f} s  {r['step'] * 1e3:>6.1f} ms  {r['step'] / base:>6.2f}x")
    say()
    say("  blocked/ckpt  median over checkpoints of the time the training loop spent inside")
    say("                gockpt (its hooks and its optimizer pre-hook) from one checkpoint's")
    say("                start to the next, timed by this demo; 'gockpt says' is the blocked_s")
    say("                gockpt itself records in metrics.jsonl.")
    say("  K             steps one checkpoint spans (* = chosen by gockpt from measured")
    say("                step time and copy bandwidth; gockpt-o with K > 1 replays the")
    say("                optimizer on the copied state with the recorded gradients).")
    say("  durable after from the checkpoint's start to its commit (written, fsynced, renamed).")
    if any(r["busy"] > 1e-3 for r in rows):
        say("  !             includes waiting for the previous checkpoint, still being written when")
        say("                the next one was due (on_busy='wait'): checkpoints too close together.")
    say("  Step times move with machine load; compare the blocked column across modes.")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- orchestration

def prepare_dir(path: str) -> None:
    if os.path.exists(path):
        if not os.path.isdir(path):
            sys.exit(f"--dir {path!r} exists and is not a directory")
        if os.listdir(path) and not os.path.exists(os.path.join(path, MARKER)):
            sys.exit(f"--dir {path!r} is not empty and was not made by this demo; refusing to "
                     "wipe it (pick another --dir)")
        shutil.rmtree(path)
    os.makedirs(os.path.join(path, "work"))
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("created by experiments/demo.py; wiped at every run\n")


def child(args, phase: str, *extra) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--dir", args.dir,
           "--steps", str(args.steps), "--every", str(args.every)]
    if args.quick:
        cmd.append("--quick")
    cmd += ["--k", str(args.k or 0)]
    return subprocess.run(cmd + list(extra)).returncode


def latest_checkpoint(ckpt_dir: str):
    """(name, manifest) of what ``<dir>/latest`` names, without loading any tensor."""
    try:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            name = f.read().strip()
        with open(os.path.join(ckpt_dir, name, "manifest.json")) as f:
            return name, json.load(f)
    except OSError:
        return None, None


def orchestrate(args) -> int:
    t_start = time.perf_counter()
    prepare_dir(args.dir)
    paths = Paths(args)
    cfg = ModelConfig()
    model, opt, _ = build(cfg)
    n = num_params(model)
    del model, opt

    header("gockpt demo: train, crash, resume bit for bit, and measure blocked time")
    say(f"  model   LLaMA-style decoder: {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, "
        f"SwiGLU {cfg.hidden}, RoPE, RMSNorm,")
    say(f"          vocab {cfg.vocab}, untied head, dropout {cfg.dropout}: {n / 1e6:.2f} M "
        f"float32 parameters")
    say(f"  optim   AdamW (2 param groups), grad-norm clipping 1.0, warmup + cosine LambdaLR")
    say(f"  state   {mb(4 * n)} weights + {mb(8 * n)} Adam moments = {mb(12 * n)} per checkpoint")
    say(f"  data    synthetic token walks along a fixed permutation (80%) or random (20%), "
        f"batch 8 x {cfg.seq_len},")
    say("          generated from seed = step, so every run sees the same data")
    say(f"  cpu     {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads")
    say(f"  files   {args.dir}/  (train/ checkpoints, bench/ phase 3, work/ losses and reference)")

    # ---------------------------------------------------------------- phase 1
    section(f"Phase 1: train {args.steps} steps with mode='gockpt-o', checkpoint every "
            f"{args.every}, crash at step {args.kill_at + 1}")
    say("  A child process trains; " + ("K (the steps one checkpoint spans) is chosen by gockpt."
                                     if args.k is None else f"K (steps one checkpoint spans) = {args.k}."))
    rc = child(args, "train", "--kill-at", str(args.kill_at))
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    crashed = rc == -signal.SIGKILL
    say(f"  child exited with {'SIGKILL (the simulated crash)' if crashed else f'code {rc}'}")
    if not crashed:
        say("  FAILED: phase 1 did not end with the crash")
        return 1
    entries = sorted(os.listdir(paths.ckpt))
    committed = [e for e in entries if e.startswith("step-")]
    partial = [e for e in entries if e.startswith(".tmp-")]
    name, manifest = latest_checkpoint(paths.ckpt)
    say(f"  on disk: {', '.join(committed) or 'nothing'}"
        + (f"  + {len(partial)} partial write(s) (.tmp-*, ignored and cleaned up)" if partial else ""))
    if manifest is None:
        say("  FAILED: no committed checkpoint to resume from")
        return 1
    resume_step = manifest["step"]
    crash_losses = read_losses(paths.crash_losses)
    say(f"  latest -> {name}: resume at step {resume_step}; the "
        f"{args.kill_at - resume_step} steps after it (up to the crash) will be redone")
    if args.k is None and manifest["overlap_steps"] == 1:
        say("  (gockpt chose K=1 here: copying the state is fast next to one training step.")
        say("   Run with --k 4 to spread each checkpoint over 4 steps with optimizer replay.)")

    # ---------------------------------------------------------------- phase 2
    section("Phase 2: resume from the latest checkpoint and verify it bit for bit")
    say(f"  Reference: an uninterrupted run without gockpt (this process), steps 0..{args.steps},")
    say(f"  saving its full state after step {resume_step} for comparison.")
    ref_model, ref_opt, ref_sched = build(total_steps=args.steps)
    ref_losses = {}
    bar = Progress(args.steps, 0, "reference run ")
    for step, loss, _ in train_loop(ref_model, ref_opt, ref_sched, 0, args.steps):
        ref_losses[step] = loss
        if step + 1 == resume_step:
            torch.save(snapshot(ref_model, ref_opt, ref_sched), paths.reference)
        bar.update(step + 1, loss)
    bar.close()
    with open(paths.reference_losses, "w") as f:
        for s, v in sorted(ref_losses.items()):
            f.write(json.dumps({"step": s, "loss": v}) + "\n")
    del ref_model, ref_opt, ref_sched
    say(f"  loss: {ref_losses[0]:.3f} at step 1 -> {ref_losses[args.steps - 1]:.3f} at step "
        f"{args.steps}")
    n_cmp, diff = compare_losses(crash_losses, ref_losses, range(args.kill_at))
    say(f"  the crashed gockpt-o run's losses, steps 1..{args.kill_at}: "
        + (f"all {n_cmp} equal to the reference (checkpointing did not perturb training)"
           if diff is None else f"DIFFER ({diff})"))
    ok = diff is None

    say("  A fresh child process restores the checkpoint and trains on:")
    rc = child(args, "resume")
    ok &= rc == 0

    # ---------------------------------------------------------------- phase 3
    section(f"Phase 3: blocked time per checkpoint, modes side by side ({args.bench_steps} "
            f"steps each)")
    rc = child(args, "bench")
    ok &= rc == 0

    # ---------------------------------------------------------------- summary
    header("Summary")
    say(f"  crash + resume from step {resume_step}: "
        + ("state and every later loss bitwise identical to an uninterrupted run" if ok
           else "VERIFICATION FAILED (see above)"))
    say(f"  total time {time.perf_counter() - t_start:.0f} s; files in {args.dir}/")
    say(f"  RESULT: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


class Paths:
    def __init__(self, args):
        self.ckpt = os.path.join(args.dir, "train")
        self.bench = os.path.join(args.dir, "bench")
        work = os.path.join(args.dir, "work")
        self.crash_losses = os.path.join(work, "losses_crashed_run.jsonl")
        self.resume_losses = os.path.join(work, "losses_resumed_run.jsonl")
        self.reference_losses = os.path.join(work, "losses_reference.jsonl")
        self.reference = os.path.join(work, "reference_state.pt")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300)")
    ap.add_argument("--dir", default="checkpoints/demo",
                    help="working directory, wiped at start (default checkpoints/demo)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint interval (default 50)")
    ap.add_argument("--kill-at", type=int, default=None,
                    help="crash during this step, 0-based (default: about 70%% of --steps)")
    ap.add_argument("--k", type=int, default=4,
                    help="overlap_steps K of phases 1-2 (default 4, so that every checkpoint is "
                         "assembled by the optimizer replay; 0: gockpt chooses from its "
                         "measurements)")
    ap.add_argument("--quick", action="store_true", help="a tiny run of every phase")
    ap.add_argument("--phase", choices=("all", "train", "resume", "bench"), default="all",
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.k is not None and args.k < 0:
        ap.error("--k must be >= 0")
    args.k = args.k or None
    args.steps = args.steps or (40 if args.quick else 300)
    args.every = args.every or (10 if args.quick else 50)
    if args.steps < 4 or args.every < 1:
        ap.error("--steps must be >= 4 and --every >= 1")
    if args.kill_at is None:
        args.kill_at = int(0.7 * args.steps)
        if args.kill_at % args.every == 0:       # not on a checkpoint boundary
            args.kill_at += max(1, args.every // 2)
    if not args.every <= args.kill_at < args.steps:
        ap.error(f"--kill-at must be in [--every, --steps) = [{args.every}, {args.steps})")
    args.bench_steps, args.bench_every = (24, 8) if args.quick else (40, 10)
    args.bench_k = 4
    paths = Paths(args)
    args.ckpt_dir, args.bench_dir = paths.ckpt, paths.bench
    args.reference, args.reference_losses = paths.reference, paths.reference_losses
    args.losses = paths.crash_losses if args.phase == "train" else paths.resume_losses
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase == "train":
        return phase_train(args)
    if args.phase == "resume":
        return phase_resume(args)
    if args.phase == "bench":
        return phase_bench(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
