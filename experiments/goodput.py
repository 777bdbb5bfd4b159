"""Goodput under real failures: one training job per scheme, run by ``torchrun --max-restarts``
(the elastic agent restarts the workers, as users run jobs), killed with SIGKILL at times drawn
from an exponential distribution with the given MTBF (seeded: every scheme faces the same
failure times, counted from its job's start), each restart loading the latest checkpoint.

    python experiments/goodput.py                     # one MTBF, every scheme, 1 rank
    python experiments/goodput.py --ranks 2           # DDP on 2 gloo ranks
    python experiments/goodput.py --mtbf 15,30,60     # a sweep
    python experiments/goodput.py --ranks 2 --failure raise   # exceptions on the last rank

Schemes (experiments/goodput_worker.py): ``none`` (a failure restarts from step 0), gockpt's
``sync``, ``async``, ``async-o``, ``gockpt-o`` (every ``--every`` steps, K = ``--k``),
``gockpt-o-auto`` (``interval="auto"`` with the MTBF; one rank only: several ranks need a
fixed interval), ``gockpt-o-memory`` (gockpt-o with the memory tier and its step log, each
rank's own on several: a restart resumes at the last step, not the last checkpoint) and ``dcp``
(``torch.distributed.checkpoint.async_save`` every ``--every``
steps, staged as PyTorch's zero-overhead checkpointing stages: on a background thread while the
next forward/backward runs, the optimizer step waiting for it). Both cross the same emulated
device link, on which a full copy of the state takes ``LINK_STEPS`` training steps (the regime
of a GPU, where DCP's pinned stager copies across PCIe as gockpt does).

The accounting is Google's categories (:mod:`gockpt.goodput`), computed here from what the
benchmark saw -- its kill times and each process's own log (one line per step) -- and, for
gockpt's schemes, also by ``gockpt goodput`` from the records gockpt left (both printed: they
agree to the resolution of gockpt's progress records). For every scheme that checkpoints, the
final state must equal, bit for bit, the state of the uninterrupted run at the same step (exit
status 1 otherwise). Written to ``--out``: ``goodput.json``, ``goodput-mtbf<M>.png`` / ``.svg``
per MTBF.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import psutil  # noqa: E402  (installed with DeepSpeed)
import torch  # noqa: E402

from gockpt import goodput as gp  # noqa: E402
from gockpt.cli.goodput import plot  # noqa: E402
from gockpt.testing import first_difference  # noqa: E402
from goodput_worker import model_config  # noqa: E402
from model import ModelConfig, build, num_params  # noqa: E402

SCHEMES = ("none", "sync", "async", "async-o", "gockpt-o", "gockpt-o-auto", "gockpt-o-memory",
           "dcp")
LINK_STEPS = 3  # one full copy of the state over the emulated link takes this many steps
TOKENS_PER_STEP = 8 * ModelConfig().seq_len
# torchrun shares its rendezvous store with the workers; after a restart, a process group
# made by new_group (gockpt's own, among others) can read the previous attempt's addresses
# from it and fail to connect (pytorch#135712): the agent's own store for the workers instead
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(args, directory: str, scheme: str, steps: int, final: str, link_gbps=None,
             mtbf=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.ranks}", "--max-restarts=1000", "--monitor-interval=0.1",
           os.path.join(HERE, "goodput_worker.py"), directory, "--scheme", scheme,
           "--steps", str(steps), "--every", str(args.every), "--k", str(args.k),
           "--dim", str(args.dim), "--layers", str(args.layers), "--final", final]
    if link_gbps:
        cmd += ["--link-gbps", f"{link_gbps:.6g}"]
    if mtbf:
        cmd += ["--mtbf", str(mtbf)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONWARNINGS="ignore", **RESTARTABLE)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def rank_worker(agent: subprocess.Popen, rank: int):
    """The agent's worker process of ``rank``, if one is running."""
    try:
        for child in psutil.Process(agent.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "goodput_worker" in " ".join(
                        child.cmdline()):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    except psutil.NoSuchProcess:
        pass
    return None


def stop(agent: subprocess.Popen) -> None:
    """Kill the agent and every process it started."""
    try:
        workers = psutil.Process(agent.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    os.killpg(agent.pid, signal.SIGKILL)
    for w in workers:
        try:
            w.kill()
        except psutil.NoSuchProcess:
            pass
    agent.wait()
    psutil.wait_procs(workers, timeout=30)


def run_job(args, scheme: str, mtbf: float, failures: list, link_gbps, out: str,
            max_wall: float) -> dict:
    """One job under the failures (seconds after its start): its logs, kills, wall times."""
    directory = os.path.join(out, f"mtbf{mtbf:g}", scheme)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    t0 = time.time()
    agent = torchrun(args, directory, scheme, args.steps, directory, link_gbps, mtbf)
    kills, pending = [], list(failures)
    while agent.poll() is None:
        now = time.time() - t0
        if now > max_wall:  # the agent and its workers (each in a session of its own)
            stop(agent)
            break
        if pending and now >= pending[0]:
            pending.pop(0)
            worker = rank_worker(agent, 0 if args.failure == "kill" else args.ranks - 1)
            if worker is not None:
                try:
                    if args.failure == "kill":
                        worker.kill()
                    else:
                        worker.send_signal(signal.SIGUSR1)
                    kills.append({"t": time.time(), "pid": worker.pid})
                except psutil.NoSuchProcess:
                    pass
            continue
        time.sleep(0.02)  # the failure clock's resolution (not a synchronisation)
    err = agent.stderr.read() if agent.stderr else ""
    finished = agent.returncode == 0
    if not finished and agent.returncode not in (-signal.SIGKILL,):
        print(f"  {scheme}: torchrun exited {agent.returncode}\n{err[-2000:]}", file=sys.stderr)
    return {"directory": directory, "kills": kills, "finished": finished,
            "logs": read_logs(directory)}


def read_logs(directory: str) -> list:
    """Rank 0's process logs, in start order: [{"pid", "process_start", "ready",
    "restored", "steps": [(step, t, blocked, committed)], "end": {...} or None}]."""
    out = []
    for name in os.listdir(directory):
        if not (name.startswith("bench-") and name.endswith(".jsonl")):
            continue
        proc = {"steps": [], "end": None, "ready": None, "restored": 0}
        with open(os.path.join(directory, name)) as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the kill
                    continue
                if ev["ev"] == "start":
                    proc.update(pid=ev["pid"], process_start=ev["process_start"])
                elif ev["ev"] == "ready":
                    proc.update(ready=ev["t"], restored=ev["restored"])
                elif ev["ev"] == "step":
                    proc["steps"].append((ev["step"], ev["t"], ev["blocked"], ev["committed"]))
                elif ev["ev"] == "end":
                    proc["end"] = ev
                elif ev["ev"] == "die":  # a failure the worker was told to inflict on itself
                    proc["died"] = ev["t"]
        if "process_start" in proc:
            out.append(proc)
    return sorted(out, key=lambda p: p["process_start"])


def account(job: dict, every: int, k: int = 1):
    """The benchmark's own accounting (the categories of gockpt.goodput) from its kill times
    and the processes' logs; also where each kill landed."""
    procs, kills = job["logs"], sorted(k["t"] for k in job["kills"])
    sec = dict.fromkeys(gp.CATEGORIES, 0.0)
    landed, curves = [], []
    for i, p in enumerate(procs):
        nxt = procs[i + 1] if i + 1 < len(procs) else None
        limit = nxt["process_start"] if nxt else float("inf")
        death = next((k for k in kills if p["process_start"] <= k < limit), p.get("died"))
        if death is None and p["end"] is None:  # ended by another rank's failure: last seen
            death = p["steps"][-1][1] if p["steps"] else (p["ready"] or p["process_start"])
        ready = p["ready"] if p["ready"] is not None else death
        if p["end"] is not None:
            stop, trained = p["end"]["t"], p["end"]["boundary_t"]
            sec["checkpoint"] += stop - trained
        else:
            stop = trained = death if death is not None else (
                p["steps"][-1][1] if p["steps"] else ready)
        sec["restore"] += ready - p["process_start"]
        blocked = sum(b for _, _, b, _ in p["steps"])
        sec["checkpoint"] += blocked
        if nxt is not None:
            sec["other"] += max(0.0, nxt["process_start"] - stop)
        # kept: what the next process that trained went on from (as gockpt.goodput counts)
        resumed = next((q for q in procs[i + 1:] if q["ready"] is not None), None)
        if resumed is None and p["end"] is not None:
            kept_until, kept_blocked = trained, blocked
        else:
            keep = resumed["restored"] if resumed is not None else max(
                [c for *_, c in p["steps"]] or [p["restored"]])
            at = next((t for s, t, _, _ in p["steps"] if s == keep), None) \
                if keep > p["restored"] else None
            kept_until = at if at is not None else ready
            kept_blocked = sum(b for s, _, b, _ in p["steps"] if s <= keep) if at else 0.0
        sec["productive"] += max(0.0, kept_until - ready - kept_blocked)
        sec["wasted"] += max(0.0, (trained - ready - blocked) - max(0.0, kept_until - ready -
                                                                   kept_blocked))
        if death is not None:
            landed.append(where(p, death, every, k))
        curves.append([(ready, p["restored"])] + [(t, s) for s, t, _, _ in p["steps"]])
    start = procs[0]["process_start"] if procs else 0.0
    last = procs[-1] if procs else None
    end = (last["end"]["t"] if last and last["end"] else max(
        [k for k in kills] + [s[1] for s in (last["steps"] if last else [])] or [start]))
    wall = end - start
    sec["other"] += wall - sum(sec.values())
    final = max((s for p in procs for s, *_ in p["steps"]), default=0)
    result = gp.Goodput(wall_s=wall, seconds=sec, failures=sum(p["end"] is None for p in procs),
                        attempts=len(procs), final_step=final, checkpoints=0,
                        interval_steps=None)
    return result, landed, [[(t - start, s) for t, s in c] for c in curves]


def where(p: dict, death: float, every: int, k: int) -> str:
    """Where a kill landed in the process it ended: its start or load, its first step, a
    window (the K - 1 steps that copy ahead of a checkpoint), a checkpoint in flight after
    its step (replay, persistence, commit), or plain training."""
    if p["ready"] is None or death < p["ready"]:
        return "restore (start or load)"
    done = [s for s in p["steps"] if s[1] <= death]
    if not done:
        return "first step"
    step, _, _, committed = done[-1]
    if every and step - step % every > max(committed, p["restored"]):
        return "checkpoint in flight"
    return "window" if k > 1 and step % every >= every - (k - 1) else "training"


def exact(directory: str, reference: str, ranks: int) -> str:
    """'bitwise' when every rank's final state is the uninterrupted run's, else why not."""
    for r in range(ranks):
        path = os.path.join(directory, f"final-rank{r}.pt")
        if not os.path.exists(path):
            return "not finished"
        diff = first_difference(torch.load(path, weights_only=False),
                                torch.load(os.path.join(reference, f"final-rank{r}.pt"),
                                           weights_only=False), f"rank{r}")
        if diff is not None:
            return f"DIFFERS: {diff}"
    return "bitwise"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtbf", default="12", help="seconds; several, comma-separated: a sweep")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128,
                    help="the model's width (the demo's model: 256, with --layers 4)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch threads per rank (default: half the cores, the other half for "
                         "the checkpointers' threads and the launcher; a preempted intra-op "
                         "thread stalls every parallel region of a step)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--failure", choices=("kill", "raise"), default="kill",
                    help="kill: SIGKILL of rank 0; raise: the last rank raises an exception "
                         "at the next point of its loop (after its forward pass or its "
                         "optimizer step), the others end on their failed collective")
    ap.add_argument("--max-wall", type=float, default=90.0,
                    help="seconds a job may run (a scheme that cannot finish is cut there)")
    ap.add_argument("--out", default=os.path.join(ROOT, "goodput-out"))
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if args.ranks > 1 and "gockpt-o-auto" in schemes:
        schemes.remove("gockpt-o-auto")  # several ranks: every rank must start the same ones
    os.makedirs(args.out, exist_ok=True)
    reference = os.path.join(args.out, "reference")
    shutil.rmtree(reference, ignore_errors=True)
    os.makedirs(reference)
    print(f"reference: {args.steps} steps without failures ({args.ranks} rank(s)) ...",
          flush=True)
    ref = run_job(args, "none", 0.0, [], None, args.out, float("inf"))
    shutil.rmtree(reference)
    shutil.move(ref["directory"], reference)
    steps_t = [t for s, t, _, _ in ref["logs"][0]["steps"]]
    step_s = (steps_t[-1] - steps_t[0]) / max(1, len(steps_t) - 1)
    state_bytes = 12 * num_params(build(model_config(args.dim, args.layers))[0])
    link_gbps = state_bytes / (LINK_STEPS * step_s) / 1e9
    print(f"  step {step_s * 1e3:.0f} ms, state {state_bytes / 1e6:.0f} MB, emulated link "
          f"{link_gbps:.3f} GB/s (a full copy in {LINK_STEPS} steps)", flush=True)
    results, bad = {}, False
    for mtbf in (float(m) for m in args.mtbf.split(",")):
        rng = random.Random(args.seed)
        failures, t = [], 0.0
        while t < args.max_wall:
            t += rng.expovariate(1.0 / mtbf)
            failures.append(t)
        print(f"\nMTBF {mtbf:g} s: failures at {', '.join(f'{f:.1f}' for f in failures)} s",
              flush=True)
        rows = {}
        for scheme in schemes:
            job = run_job(args, scheme, mtbf, failures, link_gbps, args.out, args.max_wall)
            mine, landed, curves = account(  # (none: no checkpoint ever in flight)
                job, args.every if scheme != "none" else 0,
                args.k if scheme.startswith("gockpt-o") else 1)
            row = {"bench": mine.to_dict(), "landed": landed, "finished": job["finished"],
                   "kills": len(job["kills"])}
            row["exact"] = exact(job["directory"], reference, args.ranks) \
                if scheme != "none" or job["finished"] else "not finished"
            if scheme in ("sync", "async", "async-o", "gockpt-o", "gockpt-o-auto",
                          "gockpt-o-memory"):
                row["gockpt"] = gp.read(job["directory"]).to_dict()
                bad |= row["exact"] != "bitwise"
            # the job's training throughput: steps it kept per second of wall time
            row["tokens_per_s"] = mine.final_step * TOKENS_PER_STEP / mine.wall_s \
                if mine.wall_s > 0 else 0.0
            rows[scheme] = (row, mine, curves)
            print(f"  {scheme:<14} goodput {100 * mine.goodput:5.1f}%"
                  + (f" (gockpt goodput: {100 * row['gockpt']['goodput']:5.1f}%)"
                     if "gockpt" in row else "")
                  + f"  {row['kills']} kills, final step {mine.final_step}, {row['exact']}",
                  flush=True)
        print_table(mtbf, rows)
        for ext in ("png", "svg"):
            plot({s: (m, c) for s, (_, m, c) in rows.items()},
                 os.path.join(args.out, f"goodput-mtbf{mtbf:g}.{ext}"))
        results[f"{mtbf:g}"] = {s: r for s, (r, _, _) in rows.items()}
    with open(os.path.join(args.out, "goodput.json"), "w") as f:
        json.dump({"args": vars(args), "step_s": step_s, "link_gbps": link_gbps,
                   "mtbf": results}, f, indent=1)
    print(f"\nwritten to {args.out}: goodput.json, goodput-mtbf<M>.png/.svg")
    return 1 if bad else 0


def print_table(mtbf: float, rows: dict) -> None:
    print(f"\n{'scheme':<14} {'goodput':>8} " + " ".join(f"{c:>10}" for c in gp.CATEGORIES)
          + f" {'kills':>5} {'step':>5} {'tokens/s':>9}  kills landed / final state")
    for scheme, (row, g, _) in rows.items():
        where_ = ", ".join(f"{n}x {w}" for w, n in sorted(
            {w: row["landed"].count(w) for w in row["landed"]}.items()))
        print(f"{scheme:<14} {100 * g.goodput:7.1f}% "
              + " ".join(f"{g.seconds[c]:9.1f}s" for c in gp.CATEGORIES)
              + f" {row['kills']:>5} {g.final_step:>5} {row['tokens_per_s']:>9.0f}  "
              f"{where_ or '-'} / {row['exact']}")


if __name__ == "__main__":
    sys.exit(main())
