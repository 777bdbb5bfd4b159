"""Phases 1 and 2 of the gockpt demo: the training loop, the crashing run (a child process),
the uninterrupted reference run, and the resumed run that proves the restore bitwise (a child
process). The bitwise comparison is :mod:`gockpt.testing`'s."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import gockpt
from demo_report import CommitLog, Progress, say
from gockpt.testing import first_difference, snapshot
from model import ModelConfig, batch, build

SECTIONS = (("model", "model.state_dict()"), ("optimizer", "optimizer.state_dict()"),
            ("scheduler", "scheduler.state_dict()"), ("rng", "RNG states (torch, numpy, random)"))


# ----------------------------------------------------------------------------- training loop

TOKENS_PER_STEP = 8 * ModelConfig().seq_len  # batch 8


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
                done, extra_state={"tokens_seen": done * TOKENS_PER_STEP,
                                   "loss": value},
                force=bool(ckpt_due and ckpt_due(done)))
        yield step, value, handle


# ----------------------------------------------------------------------------- loss files

def write_loss(f, step: int, loss: float) -> None:
    f.write(json.dumps({"step": step, "loss": loss}) + "\n")


def write_losses(path: str, losses: dict) -> None:
    with open(path, "w") as f:
        for s, v in sorted(losses.items()):
            write_loss(f, s, v)


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


def count_tensors(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


# ----------------------------------------------------------------------------- phase 1

def phase_train(args) -> int:
    """Child process of phase 1: train with gockpt-o and crash at --kill-at."""
    model, opt, sched = build(total_steps=args.steps)
    ck = gockpt.Checkpointer(model, opt, args.ckpt_dir, mode="gockpt-o", overlap_steps=args.k,
                             scheduler=sched, interval=args.every)
    commits = CommitLog(args.ckpt_dir)
    bar = Progress(args.steps, 0, "training (gockpt-o)")
    in_flight = []

    def on_kill(step):
        commits.print_new(bar)
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
            write_loss(out, step, loss)
            out.flush()                      # the parent reads this after the crash
            if handle is not None:
                in_flight.append(handle)
            in_flight = [h for h in in_flight if not h.done()]
            commits.print_new(bar)
            bar.update(step + 1, loss)
    # Only reached without --kill-at.
    ck.close()
    bar.close()
    return 0


# ----------------------------------------------------------------------------- phase 2

def train_reference(steps: int, save_at: int, state_path: str, losses_path: str) -> dict:
    """The uninterrupted run without gockpt (in the calling process): saves its
    :func:`gockpt.testing.snapshot` after ``save_at`` steps and every loss; returns the losses."""
    model, opt, sched = build(total_steps=steps)
    losses = {}
    bar = Progress(steps, 0, "reference run ")
    for step, loss, _ in train_loop(model, opt, sched, 0, steps):
        losses[step] = loss
        if step + 1 == save_at:
            torch.save(snapshot(model, opt, sched), state_path)
        bar.update(step + 1, loss)
    bar.close()
    write_losses(losses_path, losses)
    return losses


def phase_resume(args) -> int:
    """Child process of phase 2: gockpt.load, verify against the reference, train on."""
    model, opt, sched = build(total_steps=args.steps)   # fresh objects, fresh RNG
    t0 = time.perf_counter()
    restored = gockpt.load(args.ckpt_dir, model, opt, scheduler=sched)
    load_s = time.perf_counter() - t0
    man = restored.manifest
    say(f"  gockpt.load: {os.path.relpath(restored.path)} in {load_s * 1e3:.0f} ms "
        f"(mode {man.mode}, K={man.overlap_steps}, checksums verified)")
    say(f"  restored step {restored.step}, extra_state {restored.extra_state}")
    seen = restored.extra_state.get("tokens_seen")
    if seen != restored.step * TOKENS_PER_STEP:
        say(f"  extra_state FAILED: tokens_seen {seen} is not the position of step "
            f"{restored.step} ({restored.step * TOKENS_PER_STEP})")
        return 1
    say(f"  the checkpoint is the step it was asked for: its extra_state (given at that step) "
        f"is the data position of step {restored.step}")
    if not verify_state(snapshot(model, opt, sched), torch.load(args.reference, weights_only=True),
                        restored.step):
        say("  state verification FAILED")
        return 1
    return train_on(args, model, opt, sched, restored.step)


def verify_state(mine: dict, ref: dict, step: int) -> bool:
    """Print one verdict per section of the two snapshots; True if all are identical."""
    ok = True
    say(f"  bitwise comparison with the reference run's state after {step} steps:")
    for key, label in SECTIONS:
        diff = first_difference(mine[key], ref[key], key)
        n = count_tensors(ref[key])
        what = f"{n} tensors" if n and key != "rng" else ""
        say(f"    {label:<36} {what:>11}  " + ("identical" if diff is None else f"DIFFERS: {diff}"))
        ok &= diff is None
    return ok


def train_on(args, model, opt, sched, start: int) -> int:
    """Train the restored run on to the end -- still checkpointing, as a real resumed job
    would, the last step included (announced, so that its window ends there too; ``close()``
    would complete it even without notice) -- and compare every loss with the reference's."""
    ck = gockpt.Checkpointer(model, opt, args.ckpt_dir, mode="gockpt-o", overlap_steps=args.k,
                             scheduler=sched, interval=args.every)
    ck.plan_checkpoint(args.steps)
    commits = CommitLog(args.ckpt_dir, skip_existing=True)   # not those of the crashed run
    losses = {}
    bar = Progress(args.steps, start, "resumed run   ")
    for step, loss, _ in train_loop(model, opt, sched, start, args.steps, ck=ck):
        losses[step] = loss
        commits.print_new(bar)
        bar.update(step + 1, loss)
    ck.close()
    commits.print_new(bar)
    bar.close()
    write_losses(args.losses, losses)
    n, diff = compare_losses(losses, read_losses(args.reference_losses), range(start, args.steps))
    if diff is None:
        say(f"  losses of steps {start + 1}..{args.steps} vs the uninterrupted reference: "
            f"{n} of {n} equal")
        say("  bitwise identical: yes")
        return 0
    say(f"  bitwise identical: NO -- first difference at {diff}")
    return 1
