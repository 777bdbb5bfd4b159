"""One rank of tests/test_exit.py's jobs on several ranks (DDP on gloo, gockpt-o, a
checkpoint every 5 steps with K = 3: the window of step 10 opens at the boundary of step 8).

Scenarios (argv[2]):

- ``close``: ten steps, ``close()``; then no thread of gockpt is left -- no Python thread and
  none of its process groups' gloo workers, which would otherwise be torn down in the
  interpreter's finalization (``terminate called without an active exception``).
- ``atexit``: the same without ``close()``: the exit hook closes it; checked by a hook
  registered before gockpt's (atexit runs them last in, first out).
- ``raise-window``: rank 1 raises right after the boundary of step 10 (its last group not
  copied yet) while rank 0 trains on: every process must end, none waiting for another.
- ``raise-persist``: rank 1 raises while its persist thread writes its part of step 10 (its
  storage plugin holds the write until rank 1 abandons, so the vote comes after).
- ``raise-load``: the job restarts from step 5 with the Checkpointer built; rank 1's load
  fails half-way (injected) while rank 0 goes on into training.
- ``early-exit``: rank 1 leaves the loop after step 10 without an exception or ``close()``
  (``exit_wait_s=1``) while rank 0 trains on.

Each rank prints ``rank R: ok`` when what it checks held; the test checks exit codes, that
nothing aborted and what is committed.
"""

import atexit
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

import gockpt
from gockpt import storage

STEPS = 20


def threads() -> dict:
    """This process's threads: {thread id: name}."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                found[tid] = f.read().strip()
        except OSError:  # the thread ended meanwhile
            pass
    return found


def check_nothing_left(rank: int, born: dict) -> None:
    """No thread made while the Checkpointer was built (``born``: its process groups' gloo
    workers and transport loops, the copy engine's, gockpt's Python threads) is left."""
    left = {tid: name for tid, name in threads().items() if tid in born}
    assert not left, f"rank {rank}: threads made with the Checkpointer left: {left}"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gockpt")]


class HeldPart(storage.CheckpointWriter):
    """Rank 1's part of step 10 is held until that rank abandons its checkpoints."""

    checkpointer = None
    writing = threading.Event()

    def write_tensors(self, tensors):
        ck = HeldPart.checkpointer
        if ck is not None and ck.ranks.rank == 1 and "step-000000010" in self.tmp_path:
            HeldPart.writing.set()
            assert ck.ranks._abandoned.wait(120), "rank 1 never abandoned"
        return super().write_tensors(tensors)


BORN = {}  # the threads made while the last Checkpointer was built


def build(rank: int, directory: str, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    before = threads()
    ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=3,
                             interval=5, **options)
    BORN.clear()
    BORN.update({tid: name for tid, name in threads().items() if tid not in before})
    assert len(BORN) >= 4, BORN  # two groups of two gloo workers, at least
    return ddp, opt, ck


def step(ddp, opt, ck, s: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * s + rank)
    x = torch.randn(8, 16, generator=g)
    loss = ddp(x).pow(2).mean()
    ck.backward_begin()
    loss.backward()
    ck.update_begin()
    opt.step()
    opt.zero_grad()
    ck.save_checkpoint(s + 1)


def main():
    directory, scenario = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario == "atexit":
        def after_gockpt():  # registered first: runs after gockpt's exit hook
            check_nothing_left(rank, BORN)
            print(f"rank {rank}: ok", flush=True)
        atexit.register(after_gockpt)
    options = {"storage_writer": HeldPart} if scenario == "raise-persist" else {}
    if scenario == "early-exit":
        options["exit_wait_s"] = 1.0
    if scenario == "raise-load":
        ddp, opt, ck = build(rank, directory)
        for s in range(5):
            step(ddp, opt, ck, s, rank)
        ck.close()
        ddp, opt, ck = build(rank, directory)
        if rank == 1:
            def failing(*args, **kwargs):
                raise RuntimeError("injected: the load fails on rank 1")
            gockpt.loading.check_digests = failing
        restored = gockpt.load(directory, ddp, opt)
        for s in range(restored.step, STEPS):
            step(ddp, opt, ck, s, rank)
        raise AssertionError(f"rank {rank}: trained on alone")
    ddp, opt, ck = build(rank, directory, **options)
    HeldPart.checkpointer = ck
    for s in range(10 if scenario in ("close", "atexit") else STEPS):
        step(ddp, opt, ck, s, rank)
        if rank == 1 and s + 1 == 10:
            if scenario == "raise-window":
                raise RuntimeError("injected: rank 1 fails inside the window of step 10")
            if scenario == "early-exit":
                print(f"rank {rank}: ok (leaving early)", flush=True)
                return
        if rank == 1 and s + 1 == 11 and scenario == "raise-persist":
            assert HeldPart.writing.wait(120), "rank 1's part of step 10 was never written"
            raise RuntimeError("injected: rank 1 fails while step 10 persists")
    if scenario == "close":
        ck.close()
        check_nothing_left(rank, BORN)
        print(f"rank {rank}: ok", flush=True)
    elif scenario == "atexit":
        return  # the exit hook closes it (with the process groups alive: it needs them)
    else:
        raise AssertionError(f"rank {rank}: trained on alone")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
