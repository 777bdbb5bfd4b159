"""What a checkpoint costs the training loop, every scheme side by side in one run.

    python experiments/bench_gpu.py --json OUT                 # on a CUDA GPU
    python experiments/bench_gpu.py --emulate-link auto        # on a CPU: a paced link

Trains a GPT-like model (experiments/model.py, sized by flags) with each scheme in turn --
``none`` (no checkpoints), ``reference`` (a copy-only schedule: the state copied on a side
stream into host buffers allocated beforehand, the next optimizer step waiting for it; nothing
persisted), ``sync``, ``async``, ``async-o``, ``gockpt`` and ``gockpt-o`` (K chosen and fixed),
DCP ``async_save`` with a pinned DefaultStager (CUDA only), and ``async`` / ``gockpt-o`` (fixed
K) without the verification against the live state (``*-noverify``: what it costs), and
``gockpt-o-k-partial`` (the parameters copied at F, only the moments replayed: what an optimizer
whose parameter line the replay does not reproduce gets) -- and reports, per scheme, the
wall-time overhead over ``none``, the time the loop lost per checkpoint (median, first, by
hook; measured here: time inside the hooks and the waits of the optimizer step beyond its own
cost), time to staged and to durable, copy GB/s and host memory.

``--emulate-link GBPS`` (or ``auto``: a rate at which one full copy takes ``--copy-steps``
forward/backward passes, 3 by default) runs on the CPU with training on one thread and every
device-to-host copy paced at that rate -- the regime of the GoCkpt paper on a machine without
a GPU. Ratios are measured side by side in one process; absolute times vary with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from bench_gpu_runs import RUNS, Setup  # noqa: E402
from model import ModelConfig  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--emulate-link", metavar="GBPS|auto",
                    help="CPU only: pace device-to-host copies at GBPS (GB/s), or 'auto'")
    ap.add_argument("--copy-steps", type=float, default=3.0,
                    help="with --emulate-link auto: forward/backward passes one full copy takes")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="training steps per run")
    ap.add_argument("--every", type=int, default=16, help="checkpoint interval in steps")
    ap.add_argument("--k", type=int, default=4, help="K of the fixed-K gockpt runs")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: /dev/shm)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and args.emulate_link is None
    if not cuda and args.emulate_link is None:
        print("bench_gpu: no CUDA GPU here. Run it on a GPU machine, or emulate a link on "
              "the CPU with --emulate-link GBPS (or --emulate-link auto).", file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(1)  # training on one core; the other runs gockpt's threads
    cfg = ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers,
                      heads=max(1, args.dim // 64), hidden=int(args.dim * 8 / 3) // 8 * 8,
                      seq_len=args.seq, dropout=0.0)
    root = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    work = tempfile.mkdtemp(prefix="gockpt-bench-", dir=root)
    setup = Setup(cfg, args, "cuda" if cuda else "cpu", work)
    try:
        results = run_all(setup, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(setup, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": setup.describe(), "runs": results}, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def run_all(setup: "Setup", args) -> dict:
    results = {}
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if "none" not in names:
        names.insert(0, "none")
    for name in names:
        if name not in RUNS:
            raise SystemExit(f"bench_gpu: unknown run {name!r}; runs: {', '.join(RUNS)}")
        if name == "dcp-async" and setup.device != "cuda":
            print(f"  {name:<20} skipped: DCP's copy does not go through the emulated link")
            continue
        if name == "none":
            setup.calibrate()
        print(f"  {name:<20} ...", end="", flush=True)
        results[name] = RUNS[name](setup)
        r = results[name]
        print(f"\r  {name:<20} blocked/ckpt {fmt(r['blocked_median_s'])}  overhead "
              f"{r['overhead_vs_none']:+.1%}", flush=True)
    return results


def fmt(x) -> str:
    return "      -" if x is None else f"{x * 1e3:7.1f} ms"


def print_table(setup, results: dict) -> None:
    print()
    print(setup.headline())
    print(f"{'run':<20}{'blocked/ckpt':>13}{'first':>11}{'vs async':>9}{'vs ref':>8}"
          f"{'overhead':>10}{'staged':>9}{'durable':>9}{'copy GB/s':>10}{'host MB':>9}"
          f"{'verify':>11}")
    base = results.get("async", {}).get("blocked_median_s")
    ref = results.get("reference", {}).get("blocked_median_s")
    for name, r in results.items():
        b = r["blocked_median_s"]
        ratio = f"{b / base:8.2f}x" if b is not None and base else "        -"
        vref = f"{b / ref:7.2f}x" if b is not None and ref else "       -"
        staged = "-" if r["time_to_staged_median_s"] is None else \
            f"{r['time_to_staged_median_s']:.2f}s"
        durable = "-" if r["time_to_durable_median_s"] is None else \
            f"{r['time_to_durable_median_s']:.2f}s"
        gbps = "-" if not r["copy_gbps"] else f"{r['copy_gbps']:.2f}"
        host = "-" if not r["host_bytes"] else f"{r['host_bytes'] / 1e6:.0f}"
        print(f"{name:<20}{fmt(b):>13}{fmt(r['blocked_first_s']):>11}{ratio}{vref}"
              f"{r['overhead_vs_none']:>+10.1%}{staged:>9}{durable:>9}{gbps:>10}{host:>9}"
              f"{fmt(r.get('verify_median_s')):>11}")


if __name__ == "__main__":
    sys.exit(main())
