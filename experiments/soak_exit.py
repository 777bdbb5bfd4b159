"""Do jobs end cleanly? Many short multi-rank jobs under torchrun, each ending as a user's
script ends (no os._exit), counted by how they ended.

    python experiments/soak_exit.py [--saves 50] [--loads 50] [--baseline 0] [--out DIR]

``--saves`` jobs train DDP on 2 ranks with gockpt-o (K=3, interval=5, 10 steps, close(),
destroy_process_group()); ``--loads`` jobs load the first save's latest checkpoint into FSDP2
on 4 ranks (resharded from 2) and train a step. ``--baseline N`` runs N of each without gockpt
as well (the same training; loads through torch.distributed.checkpoint), interleaved, so that an
abort can be told apart from one torch has alone. A job passes when torchrun exits 0, every
rank printed its last line and nothing says ``terminate called`` (a C++ thread destroyed while
joinable: the abort #38 reported in 3 of 8 DDP runs of one series). A job still running after
``--timeout`` seconds is a hang: its process group is killed. Logs of failed jobs are kept in
``--out``; the counts are printed and written to ``--out``/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "soak_exit_worker.py")
RANKS = {"save": 2, "load": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(what: str, directory: str, gockpt: bool, log: str, timeout: float) -> dict:
    """One torchrun job; how it ended."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS[what]}",
           f"--master-port={free_port()}", WORKER, what, directory] \
        + ([] if gockpt else ["--no-gockpt"])
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, hung = proc.wait(), True
    seconds = time.perf_counter() - t0
    text = open(log, errors="replace").read()
    ok_lines = sum(f"rank {r}: ok" in text for r in range(RANKS[what]))
    aborted = "terminate called" in text or "exitcode  : -6" in text
    passed = rc == 0 and not hung and not aborted and ok_lines == RANKS[what]
    return {"what": what, "gockpt": gockpt, "rc": rc, "hung": hung, "aborted": aborted,
            "ranks_ok": ok_lines, "seconds": round(seconds, 2), "passed": passed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--loads", type=int, default=50)
    ap.add_argument("--baseline", type=int, default=0,
                    help="jobs of each kind without gockpt, interleaved (default 0)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a job is a hang")
    ap.add_argument("--out", default=None, help="where the logs of failed jobs and soak.json go")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="gockpt-soak-")
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gockpt-soak-work-")
    source = os.path.join(work, "source")  # the checkpoint every load reads
    plan = [("save", True, i) for i in range(args.saves)] \
        + [("save", False, i) for i in range(min(args.baseline, max(args.saves, 1)))]
    plan.sort(key=lambda p: (p[2], not p[1]))
    loads = [("load", True, i) for i in range(args.loads)] \
        + [("load", False, i) for i in range(min(args.baseline, max(args.loads, 1)))]
    loads.sort(key=lambda p: (p[2], not p[1]))
    results = []
    try:
        if args.loads or args.baseline:  # the loads' checkpoint (and DCP's copy of the state)
            for gockpt in (True, False):
                first = job("save", source, gockpt, os.path.join(out, f"source-{gockpt}.log"),
                            args.timeout)
                if not first["passed"]:
                    print(f"the loads' source checkpoint could not be saved: see {out}")
                    return 1
        for n, (what, gockpt, i) in enumerate(plan + loads):
            if what == "save":
                directory = os.path.join(work, "save")
                shutil.rmtree(directory, ignore_errors=True)
            else:
                directory = source
            log = os.path.join(out, f"{what}-{'gockpt' if gockpt else 'torch'}-{i:03d}.log")
            r = job(what, directory, gockpt, log, args.timeout)
            results.append(r)
            if r["passed"]:
                os.remove(log)
            state = "ok" if r["passed"] else ("HUNG" if r["hung"] else
                                             "ABORTED" if r["aborted"] else f"rc {r['rc']}")
            print(f"[{n + 1}/{len(plan) + len(loads)}] {what} on {RANKS[what]} ranks "
                  f"{'with gockpt' if gockpt else 'torch alone'}: {state} "
                  f"({r['seconds']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'job':<28} {'runs':>5} {'exit 0':>7} {'aborted':>8} {'hung':>5} {'other':>6} "
          f"{'s/job':>6}")
    summary = []
    for what in ("save", "load"):
        for gockpt in (True, False):
            rs = [r for r in results if r["what"] == what and r["gockpt"] == gockpt]
            if not rs:
                continue
            row = {"job": f"{what} on {RANKS[what]} ranks, " + ("gockpt" if gockpt else "torch alone"),
                   "runs": len(rs), "passed": sum(r["passed"] for r in rs),
                   "aborted": sum(r["aborted"] for r in rs), "hung": sum(r["hung"] for r in rs),
                   "seconds": sum(r["seconds"] for r in rs) / len(rs)}
            row["other"] = row["runs"] - row["passed"] - row["aborted"] - row["hung"]
            summary.append(row)
            print(f"{row['job']:<28} {row['runs']:>5} {row['passed']:>7} {row['aborted']:>8} "
                  f"{row['hung']:>5} {row['other']:>6} {row['seconds']:>6.1f}")
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump({"summary": summary, "jobs": results}, f, indent=1)
    print(f"\nlogs of failed jobs and soak.json in {out}")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
