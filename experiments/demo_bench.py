"""Phase 3 of the gockpt demo (a child process): how long each checkpoint blocks training, every
mode on the same model, timed by the demo around gockpt's hooks and compared with what gockpt
records itself (:func:`gockpt.metrics.read`)."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import gockpt
from demo_phases import train_loop
from demo_report import Progress, mb, say
from model import build

BENCH_MODES = ("sync", "async", "async-o", "gockpt-o")

LEGEND = (
    "  blocked/ckpt  median over checkpoints of the time the training loop spent inside",
    "                gockpt (its hooks and its optimizer pre-hook) from one checkpoint's",
    "                start to the next, timed by this demo; 'gockpt says' is the blocked_s",
    "                gockpt itself records in metrics.jsonl.",
    "  K             steps one checkpoint spans (* = chosen by gockpt from measured",
    "                step time and copy bandwidth; gockpt-o with K > 1 replays the",
    "                optimizer on the copied state with the recorded gradients).",
    "  durable after from the checkpoint's start to its commit (written, fsynced, renamed).",
    "  link          'memcpy': the copies are this CPU's memcpys (fast next to a step, so",
    "                spreading them over K steps buys little); 'emulated': every copy is",
    "                paced like a device link on which one full copy takes {link_steps}",
    "                training steps -- the regime of a GPU, where gockpt-o hides the copy",
    "                under forward/backward and async stops training for all of it.",
)

# With the emulated link one full copy of the state takes this many (mean) training steps.
LINK_STEPS = 3


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

    def plan_checkpoint(self, step):
        self.ck.plan_checkpoint(step)

    def window(self, start, stop):
        return sum(v for k, v in self.spent.items() if start <= k < stop)


def phase_bench(args) -> int:
    """Child process of phase 3: blocked time per checkpoint, every mode on the same model.

    The runs go one after another (running them interleaved would make the background work
    of a checkpoint look faster in wall-clock time than it is); the run without checkpointing
    goes first and last. Then, unless ``--quick``, every run again in the opposite order, so
    that the machine's drift over the phase falls alike on every mode: a row is the mean of
    its two runs, the step time without checkpoints the mean of its four."""
    steps, every = args.bench_steps, args.bench_every
    due = list(range(every, steps - every + 1, every))
    shutil.rmtree(args.bench_dir, ignore_errors=True)
    configs = [("(none)", None, None, False)] + [(m, m, None, False) for m in BENCH_MODES] + \
        [("gockpt-o", "gockpt-o", args.bench_k, False), ("async", "async", None, True),
         ("gockpt-o", "gockpt-o", args.bench_k, True), ("(none)", None, None, False)]
    order = configs if args.quick else configs + configs[::-1]

    # Warm up kernels and the allocator on a throwaway model so the first run is not penalised.
    model, opt, sched = build(total_steps=steps)
    for _ in train_loop(model, opt, sched, 0, 3):
        pass

    runs = []
    bar = Progress(steps * len(order), 0, f"{len(order)} runs x {steps} steps", lines=False)
    link_gbps = None
    for label, mode, k, emulated in order:
        d = os.path.join(args.bench_dir, (f"{mode}-k{k}" if k else str(mode))
                         + ("-link" if emulated else "") + f"-{len(runs)}")
        run = {"label": label, "mode": mode, "k": k, "dir": d, "emulated": emulated}
        run.update(timed_run(mode, k, d, steps, due,
                             lambda step, loss: bar.update(len(runs) * steps + step + 1, loss),
                             link_gbps if emulated else None))
        runs.append(run)
        if link_gbps is None and len(runs) > 1:  # from the state size and the first step time
            link_gbps = gockpt.metrics.read(d)[0]["state_bytes"] / (
                LINK_STEPS * statistics.mean(runs[0]["times"][1:])) / 1e9
        what = "no checkpointing" if mode is None else f"mode={mode!r:<10} overlap_steps={k}" \
            + (f" link {link_gbps:.3f} GB/s" if emulated else "")
        bar.write(f"  run {len(runs)}/{len(order)}  {what:<40} mean step "
                  f"{statistics.mean(run['times'][1:]) * 1e3:6.1f} ms")
    bar.close()

    # step 0 of a fresh model is slower for every run alike: leave it out
    base = statistics.mean(t for r in runs if r["mode"] is None for t in r["times"][1:])
    rows = [combine([summarise(r, due, every) for r in runs
                     if (r["label"], r["mode"], r["k"], r["emulated"]) == config])
            for config in configs[1:-1]]
    ok = all(r["committed"] == len(due) for r in rows)
    for r in rows:
        if r["committed"] != len(due):
            say(f"  {r['label']}: expected {len(due)} committed checkpoints, got {r['committed']}")
    say(f"  {steps} steps per run, checkpoints at steps {', '.join(map(str, due))}; "
        f"{mb(rows[0]['state'])} of state per checkpoint"
        + ("" if args.quick else "; every run twice, in opposite orders: the means"))
    say()
    print_table(rows, base)
    return 0 if ok else 1


def combine(rows: list) -> dict:
    """One table row of a mode's runs: the means of their timings, the fewest checkpoints
    committed, the longest wait for a busy previous checkpoint, every K chosen."""
    out = dict(rows[0])
    out["K"] = sorted({k for r in rows for k in r["K"]})
    out["grad"] = max(r["grad"] for r in rows)
    for key in ("watch_s", "lib_s", "durable", "step"):
        out[key] = statistics.mean(r[key] for r in rows)
    out["committed"] = min(r["committed"] for r in rows)
    out["busy"] = max(r["busy"] for r in rows)
    return out


def timed_run(mode, k, directory: str, steps: int, due: list, progress,
              link_gbps=None) -> dict:
    """Train ``steps`` steps on a fresh model under ``mode`` (None: no checkpointing), a
    checkpoint at each step of ``due`` (announced: the replay modes copy over the K steps up
    to it), copies paced at ``link_gbps`` if given: {"watch": Stopwatch or None, "times": [s]}."""
    model, opt, sched = build(total_steps=steps)
    ck = watch = None
    if mode is not None:
        watch = Stopwatch(opt)
        ck = gockpt.Checkpointer(model, opt, directory, mode=mode, overlap_steps=k,
                                 scheduler=sched, emulate_link_gbps=link_gbps)
        watch.attach(ck, opt)
        for step in due:
            watch.plan_checkpoint(step)
    times = []
    t = time.perf_counter()
    for step, loss, _ in train_loop(model, opt, sched, 0, steps, ck=watch,
                                    ckpt_due=lambda s: s in due):
        now = time.perf_counter()
        times.append(now - t)
        t = now
        progress(step, loss)
    if ck is not None:
        ck.close()
    return {"watch": watch, "times": times}


def summarise(run: dict, due: list, every: int) -> dict:
    """One table row: the demo's timings of a run and what gockpt recorded for it."""
    recs = gockpt.metrics.read(run["dir"])
    return {**run, "committed": len(recs),
            "K": sorted({m["overlap_steps"] for m in recs}),
            # from each checkpoint's first boundary (K - 1 before its step) to the next's
            "watch_s": statistics.median(run["watch"].window(m["start_step"],
                                                             m["start_step"] + every)
                                         for m in recs),
            "lib_s": statistics.median(m["blocked_s"] for m in recs),
            "durable": statistics.median(m["time_to_durable_s"] for m in recs),
            "busy": max(m["blocked_by_hook_s"].get("save_checkpoint_busy_wait", 0.0)
                        for m in recs),
            "state": recs[0]["state_bytes"],
            "grad": max(m["grad_bytes"] for m in recs),
            "step": statistics.mean(run["times"][1:])}


def print_table(rows: list, base: float) -> None:
    """The mode table and its legend."""
    def async_of(r):  # "vs async": against async on the same link
        return next(a["watch_s"] for a in rows
                    if a["mode"] == "async" and a["emulated"] == r["emulated"])

    say(f"  {'mode':<9} {'link':<8} {'K':>2}  {'blocked/ckpt':>12}  {'vs async':>8}  "
        f"{'gockpt says':>11}  {'durable after':>13}  {'mean step':>9}  {'vs none':>7}")
    say(f"  {'-' * 9} {'-' * 8} {'-' * 2}  {'-' * 12}  {'-' * 8}  {'-' * 11}  {'-' * 13}  "
        f"{'-' * 9}  {'-' * 7}")
    say(f"  {'(none)':<9} {'-':<8} {'-':>2}  {'-':>12}  {'':>8}  {'':>11}  {'-':>13}  "
        f"{base * 1e3:>6.1f} ms  {'1.00x':>7}")
    for r in rows:
        k = ",".join(map(str, r["K"])) + ("" if r["k"] else "*")
        busy = "!" if r["busy"] > 1e-3 else " "
        ref = async_of(r)
        link = "emulated" if r["emulated"] else "memcpy"
        say(f"  {r['label']:<9} {link:<8} {k:>2}  {r['watch_s'] * 1e3:>9.1f} ms{busy} "
            f"{r['watch_s'] / ref:>7.2f}x  {r['lib_s'] * 1e3:>8.1f} ms  "
            f"{r['durable']:>11.2f} s  {r['step'] * 1e3:>6.1f} ms  {r['step'] / base:>6.2f}x")
    say()
    for line in LEGEND:
        say(line.format(link_steps=LINK_STEPS))
    if any(r["busy"] > 1e-3 for r in rows):
        say("  !             includes waiting for the previous checkpoint, still being written when")
        say("                the next one was due (on_busy='wait'): checkpoints too close together.")
    say("  Step times move with machine load; compare the blocked column across modes.")
