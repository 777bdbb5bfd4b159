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
import contextlib
import faulthandler
import gc
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

import bench_gpu_deepspeed  # noqa: E402
from bench_gpu_runs import RUNS as TORCH_RUNS, Setup  # noqa: E402
from model import ModelConfig  # noqa: E402

RUNS = {**TORCH_RUNS, **bench_gpu_deepspeed.RUNS}
ALL = list(RUNS)
# Each size's model, loop and runs. 370m: a ~370M-parameter GPT (state 4.4 GB); 2.2b: one whose
# state (26.5 GB) takes longer to copy than a forward/backward takes on an H100 -- the regime a
# multi-step copy is for -- with the runs that say most (two of its checkpoints, a copy on the
# host and a pinned DCP staging must fit in memory at once).
SIZES = {
    "tiny": dict(dim=256, layers=4, vocab=2048, seq=64, batch=8, steps=64, every=16, runs=ALL),
    "370m": dict(dim=1024, layers=24, vocab=32000, seq=1024, batch=8, steps=100, every=30,
                 runs=ALL),
    "2.2b": dict(dim=2560, layers=26, vocab=32000, seq=1024, batch=4, steps=100, every=30,
                 runs=["none", "reference", "async-o", "gockpt-o", "gockpt-o-k", "dcp-async",
                       "ds-none", "ds-native", "ds-gockpt-o"]),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--emulate-link", metavar="GBPS|auto",
                    help="CPU only: pace device-to-host copies at GBPS (GB/s), or 'auto'")
    ap.add_argument("--copy-steps", type=float, default=3.0,
                    help="with --emulate-link auto: forward/backward passes one full copy takes")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="the model and loop: tiny (seconds on a CPU), 370m (state 4.4 GB), "
                         "2.2b (state 26.5 GB: a copy longer than a forward/backward on an H100); "
                         "the flags below override it")
    for flag in ("dim", "layers", "vocab", "seq", "batch"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="training steps per run")
    ap.add_argument("--every", type=int, default=None, help="checkpoint interval in steps")
    ap.add_argument("--k", type=int, default=4, help="K of the fixed-K gockpt runs")
    ap.add_argument("--ds-grad-transport", choices=("auto", "fp32", "bf16"), default="auto",
                    help="how the DeepSpeed replay runs' gradients cross (auto: the patch's "
                         "default, bf16 across a link; on the CPU its encoding runs on the "
                         "training thread, where a GPU queues it on the device)")
    ap.add_argument("--runs", default=None,
                    help="comma-separated runs (default: the size's; all: " + ", ".join(ALL) + ")")
    ap.add_argument("--markdown", metavar="OUT", help="write the table as markdown")
    ap.add_argument("--trace", default="", metavar="RUN[,RUN]",
                    help="after the runs, each of these (torch loop runs) once more under "
                         "torch.profiler, around a checkpoint's F: TRACE_DIR/trace-RUN.txt "
                         "and .json.gz (where a window's time goes; not in the table)")
    ap.add_argument("--run-timeout", type=float, default=None, metavar="S",
                    help="a run still going after S seconds is stopped and recorded as failed, "
                         "with every thread's stack on stderr (the next runs go on)")
    ap.add_argument("--trace-dir", default=None,
                    help="where --trace writes (default: --json's directory, else .)")
    ap.add_argument("--dir", default=None,
                    help="where checkpoints go (default: /dev/shm where it has room)")
    args = ap.parse_args(argv)
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


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
    setup = Setup(cfg, args, "cuda" if cuda else "cpu", None)
    setup.calibrate()
    setup.work = work = work_dir(args, setup.state_bytes)

    def write(results: dict) -> None:  # after every run: a later one may not finish
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(setup, results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": setup.describe(), "runs": results}, f, indent=2)

    try:
        results = run_all(setup, args, write)
        trace_runs(setup, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(setup, results)
    if args.json:
        print(f"\nwrote {args.json}")
    return 1 if any("error" in r for r in results.values()) else 0


def run_all(setup: "Setup", args, write=lambda results: None) -> dict:
    """Every run in turn; one that fails is recorded with its error and the next goes on."""
    results = {}
    names = args.runs if isinstance(args.runs, list) else \
        [n.strip() for n in args.runs.split(",") if n.strip()]
    for name in names:
        if name not in RUNS:
            raise SystemExit(f"bench_gpu: unknown run {name!r}; runs: {', '.join(ALL)}")
    if "none" not in names:
        names.insert(0, "none")
    deepspeed = [n for n in names if n.startswith("ds-")]
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        print(f"  skipped {', '.join(deepspeed)}: DeepSpeed is not installed")
        names = [n for n in names if n not in deepspeed]
    elif deepspeed and "ds-none" not in names:
        names.insert(names.index(deepspeed[0]), "ds-none")
    for name in names:
        if name in results:  # (its baseline failed)
            continue
        if name == "dcp-async" and setup.device != "cuda":
            print(f"  {name:<20} skipped: DCP's copy does not go through the emulated link")
            continue
        print(f"  {name:<20} ...", end="", flush=True)
        try:
            with time_limit(args.run_timeout, name):
                results[name] = RUNS[name](setup)
        except Exception as exc:  # noqa: BLE001 -- recorded; the other runs still say much
            traceback.print_exc()
            results[name] = failed(exc)
            if name in ("none", "ds-none"):  # what the others are measured against
                results.update({n: failed(f"{name} failed") for n in names if n not in results
                                and n.startswith("ds-") == (name == "ds-none")})
        release(setup)
        write(results)
        r = results[name]
        print(f"\r  {name:<20} " + (f"failed: {r['error']}" if "error" in r else
                                     f"blocked/ckpt {fmt(r['blocked_median_s'])}  overhead "
                                     f"{r['overhead_vs_none']:+.1%}"), flush=True)
    return results


def trace_runs(setup: "Setup", args) -> None:
    """--trace: each named run again under the profiler (after the measured runs: the
    profiler's own cost stays out of them)."""
    where = args.trace_dir or os.path.dirname(os.path.abspath(args.json or "x"))
    for name in [n.strip() for n in args.trace.split(",") if n.strip()]:
        if name not in RUNS or name.startswith("ds-"):
            print(f"  trace {name}: not a run of the torch loop; runs: {', '.join(ALL)}")
            continue
        setup.trace = os.path.join(where, f"trace-{name}")
        print(f"  trace {name:<14} ...", end="", flush=True)
        try:
            with time_limit(args.run_timeout, f"{name} (traced)"):
                RUNS[name](setup)
            print(f"\r  trace {name:<14} wrote {setup.trace}.txt, .json.gz", flush=True)
        except Exception:  # noqa: BLE001 -- the measured runs are already written
            traceback.print_exc()
        finally:
            setup.trace = None
            release(setup)


@contextlib.contextmanager
def time_limit(seconds: Optional[float], name: str):
    """--run-timeout: every thread's stack on stderr and a TimeoutError in the run once
    ``seconds`` have passed (raised when the training thread next runs Python)."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"run {name} still going after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def failed(exc) -> dict:
    """The record of a run that did not finish."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return {"error": text.splitlines()[0][:300] if text else "failed",
            "blocked_median_s": None, "blocked_first_s": None, "overhead_vs_none": None}


def release(setup: "Setup") -> None:
    """What one run left behind, before the next: its checkpoints, its memory (the device's
    cache, and the pinned host blocks torch keeps cached after they are freed)."""
    for name in os.listdir(setup.work):
        shutil.rmtree(os.path.join(setup.work, name), ignore_errors=True)
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


def work_dir(args, state_bytes: int) -> str:
    """--dir, else /dev/shm where it holds a checkpoint (each run deletes its checkpoints once
    committed) and host memory holds it beside the host copies of the state (up to 2.5 of
    them: gockpt's, or DCP's staging), else the temporary directory."""
    need = int(1.2 * state_bytes)
    if args.dir:
        return tempfile.mkdtemp(prefix="gockpt-bench-", dir=args.dir)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need and \
            ram > need + 2.5 * state_bytes:
        return tempfile.mkdtemp(prefix="gockpt-bench-", dir="/dev/shm")
    if shutil.disk_usage(tempfile.gettempdir()).free > need:
        return tempfile.mkdtemp(prefix="gockpt-bench-")
    raise SystemExit(f"bench_gpu: no room for a checkpoint of {state_bytes / 1e9:.1f} GB in "
                     f"/dev/shm or {tempfile.gettempdir()}; name a directory with --dir")


def fmt(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


COLUMNS = ("run", "blocked/ckpt", "first", "in hooks", "wall lost", "vs ref", "vs dcp", "vs ds-native", "overhead",
           "staged", "durable", "copy GB/s", "host MB", "verify")


def table_rows(results: dict) -> list:
    """One row of strings per run, in COLUMNS' order. The ratios are of the median blocked
    time per checkpoint: against the copy-only reference, DCP's async_save and (for the
    DeepSpeed runs) DeepSpeed's own save_checkpoint."""
    def base(name):
        return results.get(name, {}).get("blocked_median_s")

    def ratio(b, against):
        return f"{b / against:.2f}x" if b is not None and against else "-"

    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, f"failed: {r['error'][:80]}"] + ["-"] * (len(COLUMNS) - 2))
            continue
        b = r["blocked_median_s"]
        ds = name.startswith("ds-")
        rows.append([
            name, fmt(b), fmt(r["blocked_first_s"]), fmt(r.get("gockpt_blocked_median_s")),
            fmt(r.get("wall_lost_median_s")),
            "-" if ds else ratio(b, base("reference")), "-" if ds else ratio(b, base("dcp-async")),
            ratio(b, base("ds-native")) if ds else "-",
            f"{r['overhead_vs_none']:+.1%}",
            "-" if r.get("time_to_staged_median_s") is None else
            f"{r['time_to_staged_median_s']:.2f}s",
            "-" if r.get("time_to_durable_median_s") is None else
            f"{r['time_to_durable_median_s']:.2f}s",
            "-" if not r.get("copy_gbps") else f"{r['copy_gbps']:.2f}",
            "-" if not r.get("host_bytes") else f"{r['host_bytes'] / 1e6:.0f}",
            fmt(r.get("verify_median_s"))])
    return rows


def print_table(setup, results: dict) -> None:
    print()
    print(setup.headline())
    widths = [20] + [max(len(c), 9) + 2 for c in COLUMNS[1:]]
    for row in [list(COLUMNS)] + table_rows(results):
        print(row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:])))


def markdown(setup, results: dict) -> str:
    lines = [setup.headline(), "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    lines += ["", "Blocked: the time the training loop lost per checkpoint (median, and the "
              "first); in hooks: gockpt's hooks on the training thread as the library counts "
              "them (`blocked_s`: the same count in the custom loop and the DeepSpeed engine); "
              "wall lost: what the steps of a checkpoint's window took beyond the loop's "
              "median step (on the CPU also gockpt's threads contending for the cores); "
              "overhead: wall time against `none` (the DeepSpeed runs: against `ds-none`) "
              "over the whole run, first checkpoint included."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
