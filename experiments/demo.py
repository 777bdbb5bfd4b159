"""gockpt demo: train, crash, resume, verify bit for bit, and measure what checkpointing costs.

Run from the repository root::

    python experiments/demo.py            # full demo (about 3 minutes on 2 CPU cores)
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

The phases live in ``demo_phases.py`` (1 and 2) and ``demo_bench.py`` (3), what is printed in
``demo_report.py``; the state snapshots and their bitwise comparison are ``gockpt.testing``'s.

Exit status 0 only if everything verified. Nothing here is timing-sensitive for correctness:
the bitwise checks hold whatever the machine load; only the numbers of phase 3 vary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):          # `model`, `demo_*` from experiments/, `gockpt` from the repo root
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

from demo_bench import phase_bench  # noqa: E402
from demo_phases import (compare_losses, phase_resume, phase_train, read_losses,  # noqa: E402
                         train_reference)
from demo_report import header, mb, say, section  # noqa: E402
from gockpt import storage  # noqa: E402
from gockpt.core.errors import GockptError  # noqa: E402
from gockpt.storage import manifest  # noqa: E402
from model import ModelConfig, build, num_params  # noqa: E402

MARKER = ".gockpt-demo"          # marks a directory this demo may wipe


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
    """(name, typed manifest) of the checkpoint to resume from, without loading any tensor;
    (None, None) if there is none."""
    try:
        path, man = manifest.read(storage.resolve(ckpt_dir))
    except GockptError:
        return None, None
    return os.path.basename(path), man


def orchestrate(args) -> int:
    t_start = time.perf_counter()
    prepare_dir(args.dir)
    paths = Paths(args)
    describe_setup(args)
    resume_step = phase1(args, paths)
    if resume_step is None:
        return 1
    ok = phase2(args, paths, resume_step)

    section(f"Phase 3: blocked time per checkpoint, modes side by side ({args.bench_steps} "
            f"steps each)")
    rc = child(args, "bench")
    ok &= rc == 0

    header("Summary")
    say(f"  crash + resume from step {resume_step}: "
        + ("state and every later loss bitwise identical to an uninterrupted run" if ok
           else "VERIFICATION FAILED (see above)"))
    say(f"  total time {time.perf_counter() - t_start:.0f} s; files in {args.dir}/")
    say(f"  RESULT: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def describe_setup(args) -> None:
    cfg = ModelConfig()
    model, opt, _ = build(cfg)
    n = num_params(model)
    del model, opt
    header("gockpt demo: train, crash, resume bit for bit, and measure blocked time")
    say(f"  model   LLaMA-style decoder: {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, "
        f"SwiGLU {cfg.hidden}, RoPE, RMSNorm,")
    say(f"          vocab {cfg.vocab}, untied head, dropout {cfg.dropout}: {n / 1e6:.2f} M "
        f"float32 parameters")
    say("  optim   AdamW (2 param groups), grad-norm clipping 1.0, warmup + cosine LambdaLR")
    say(f"  state   {mb(4 * n)} weights + {mb(8 * n)} Adam moments = {mb(12 * n)} per checkpoint")
    say(f"  data    synthetic token walks along a fixed permutation (80%) or random (20%), "
        f"batch 8 x {cfg.seq_len},")
    say("          generated from seed = step, so every run sees the same data")
    say(f"  cpu     {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads")
    say(f"  files   {args.dir}/  (train/ checkpoints, bench/ phase 3, work/ losses and reference)")


def phase1(args, paths) -> "int | None":
    """Train and crash in a child process; the step to resume from, or None on failure."""
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
        return None
    committed = storage.list_checkpoints(paths.ckpt)
    partial = [e for e in os.listdir(paths.ckpt) if e.startswith(storage.TMP_PREFIX)]
    name, man = latest_checkpoint(paths.ckpt)
    say(f"  on disk: {', '.join(committed) or 'nothing'}"
        + (f"  + {len(partial)} partial write(s) (.tmp-*, ignored and cleaned up)" if partial else ""))
    if man is None:
        say("  FAILED: no committed checkpoint to resume from")
        return None
    say(f"  latest -> {name}: resume at step {man.step}; the "
        f"{args.kill_at - man.step} steps after it (up to the crash) will be redone")
    if args.k is None and man.overlap_steps == 1:
        say("  (gockpt chose K=1 here: copying the state is fast next to one training step.")
        say("   Run with --k 4 to spread each checkpoint over 4 steps with optimizer replay.)")
    return man.step


def phase2(args, paths, resume_step: int) -> bool:
    """The reference run here, then the resumed run in a child process; True if all verified."""
    section("Phase 2: resume from the latest checkpoint and verify it bit for bit")
    say(f"  Reference: an uninterrupted run without gockpt (this process), steps 0..{args.steps},")
    say(f"  saving its full state after step {resume_step} for comparison.")
    ref_losses = train_reference(args.steps, resume_step, paths.reference, paths.reference_losses)
    say(f"  loss: {ref_losses[0]:.3f} at step 1 -> {ref_losses[args.steps - 1]:.3f} at step "
        f"{args.steps}")
    n_cmp, diff = compare_losses(read_losses(paths.crash_losses), ref_losses, range(args.kill_at))
    say(f"  the crashed gockpt-o run's losses, steps 1..{args.kill_at}: "
        + (f"all {n_cmp} equal to the reference (checkpointing did not perturb training)"
           if diff is None else f"DIFFER ({diff})"))
    say("  A fresh child process restores the checkpoint and trains on:")
    rc = child(args, "resume")
    return diff is None and rc == 0


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
