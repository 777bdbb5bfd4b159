"""What the verification costs the training loop: every mode with ``verify`` on and off, side by
side in one run, on the demo's model.

    python experiments/bench_verify.py [--steps 40] [--every 10] [--reps 3] [--k 4]
                                       [--modes sync,...] [--threads N]

Each mode runs with the verification on (the default: every stored tensor digested live at F
and staged, compared before the commit) and off, interleaved with runs without checkpointing,
``--reps`` times; a checkpoint every ``--every`` steps (announced, so the replay modes copy over
the K steps up to it). Reported per mode: mean step time on and off against no checkpointing,
the difference on - off, and the digests' time per checkpoint from gockpt's metrics
(``verify_live_s``: the live tensors at F on gockpt's digest thread; ``verify_s`` minus that:
the staged copy on the replay's threads) -- the digests run in gockpt's C++ core, one pass
over memory each, never on torch's intra-op threads. ``gockpt-o link`` paces the copies like a
device link on which one full copy takes 3 steps (as the demo's table does). ``--threads``
sets torch's intra-op threads (default: torch's, one per core): with every core in the step's
parallel regions, each moment a checkpoint thread takes a core stalls the other training
thread at the region's end as well, so the same background work costs about twice its time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import gockpt  # noqa: E402
from demo_phases import train_loop  # noqa: E402
from model import build  # noqa: E402

MODES = [("sync", "sync", None, False), ("async", "async", None, False),
         ("async-o", "async-o", None, False), ("gockpt-o", "gockpt-o", 4, False),
         ("gockpt-o link", "gockpt-o", 4, True)]
LINK_STEPS = 3  # with the emulated link one full copy takes this many (mean) steps


def timed_run(steps: int, due: list, directory: str, mode=None, k=None, verify=True,
              link_gbps=None) -> float:
    """Mean step time (s) of ``steps`` steps on a fresh model (step 0 left out)."""
    model, opt, sched = build(total_steps=steps)
    ck = None
    if mode is not None:
        shutil.rmtree(directory, ignore_errors=True)
        ck = gockpt.Checkpointer(model, opt, directory, mode=mode, overlap_steps=k,
                                 scheduler=sched, verify=verify, emulate_link_gbps=link_gbps)
        for step in due:
            ck.plan_checkpoint(step)
    times, t = [], time.perf_counter()
    for _ in train_loop(model, opt, sched, 0, steps, ck=ck, ckpt_due=lambda s: s in due):
        now = time.perf_counter()
        times.append(now - t)
        t = now
    if ck is not None:
        ck.close()
    return statistics.mean(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--modes", default=",".join(m[0].replace(" ", "-") for m in MODES),
                    help="comma-separated, of: %(default)s")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in MODES if m[0].replace(" ", "-") in args.modes.split(",")]
    due = list(range(args.every, args.steps - args.every + 1, args.every))
    root = tempfile.mkdtemp(prefix="gockpt-verify-")
    try:
        for _ in train_loop(*build(total_steps=3), 0, 3):  # warm up kernels and allocator
            pass
        base = [timed_run(args.steps, due, root)]
        bytes_per_ckpt = None
        link = None
        step_t, digests = {}, {}
        for rep in range(args.reps):
            for label, mode, k, emulated in modes:
                if emulated and link is None:  # from the state size and the first step time
                    state = bytes_per_ckpt or 12 * sum(  # fp32 weights and two moments
                        p.numel() for p in build(total_steps=1)[0].parameters())
                    link = state / (LINK_STEPS * statistics.mean(base)) / 1e9
                for verify in (True, False):
                    d = os.path.join(root, f"{label}-{verify}".replace(" ", "-"))
                    step_t.setdefault((label, verify), []).append(timed_run(
                        args.steps, due, d, mode, k and args.k, verify,
                        link if emulated else None))
                    recs = gockpt.metrics.read(d)
                    bytes_per_ckpt = bytes_per_ckpt or recs[0]["state_bytes"]
                    if verify:
                        digests.setdefault(label, []).extend(
                            (r["verify_live_s"], r["verify_s"] - r["verify_live_s"])
                            for r in recs)
            base.append(timed_run(args.steps, due, root))
            print(f"  repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    none = statistics.mean(base)
    print(f"{args.steps} steps per run, checkpoints at {', '.join(map(str, due))}, "
          f"{bytes_per_ckpt / 1e6:.1f} MB of state, {args.reps} repetitions interleaved, "
          f"{torch.get_num_threads()} torch threads; no checkpointing {none * 1e3:.1f} ms per step")
    print(f"{'mode':<14} {'verify on':>10} {'verify off':>10} {'on - off':>9}  "
          f"{'live digests':>12} {'staged digests':>14}  (per checkpoint)")
    for label, *_ in modes:
        on = statistics.mean(step_t[(label, True)])
        off = statistics.mean(step_t[(label, False)])
        live = statistics.median(d[0] for d in digests[label]) * 1e3
        staged = statistics.median(d[1] for d in digests[label]) * 1e3
        print(f"{label:<14} {on / none:>9.3f}x {off / none:>9.3f}x {(on - off) / none:>+8.1%}  "
              f"{live:>9.1f} ms {staged:>11.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
