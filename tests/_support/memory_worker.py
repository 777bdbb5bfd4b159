"""One rank of tests/test_memory_tier.py's jobs of several ranks (started by
tests/_support/dist_ranks.py): DDP replicas, whose checkpoint is written in shares (a load reads
every rank's part), with the memory tier in ``GOCKPT_TEST_SHM``. Exits non-zero on any
mismatch.

Scenarios: ``load`` -- the memory copy is a whole checkpoint of every rank, loaded bitwise on
every rank; one byte of rank 1's part damaged in memory makes every rank load the disk's (a
warning on each); close() removes the copies. ``hosts`` -- the step log refused on several ranks; ranks declared on two hosts: the tier is
off, with a warning, on every rank."""

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import gockpt
from gockpt import storage
from gockpt.storage import memory_tier
from gockpt.testing import assert_same, snapshot
from tests._support.cli_helpers import flip_byte
from tests._support.exit_worker import step


def build():
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)))
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def train(ddp, opt, ck, steps, rank):
    for s in range(steps):
        step(ddp, opt, ck, s, rank)
    ck.wait()


def load(directory, shm):
    ddp, opt = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = gockpt.load(directory, ddp, opt, memory_dir=shm)
    return restored, snapshot(ddp, opt), [str(w.message) for w in caught]


def main():
    directory, scenario = sys.argv[1], sys.argv[2]
    shm = os.environ["GOCKPT_TEST_SHM"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario == "hosts":
        ddp, opt = build()
        try:  # (the step log: one process for now, refused on every rank alike)
            gockpt.Checkpointer(ddp, opt, directory, memory="auto", memory_dir=shm,
                                memory_log=1 << 20)
        except gockpt.ConfigError as exc:
            assert "the step log keeps one process's steps" in str(exc), exc
        else:
            raise AssertionError("memory_log on several ranks was not refused")
        os.environ["GOCKPT_HOST"] = f"host-{rank}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=2,
                                     interval=3, memory="auto", memory_dir=shm)
        assert ck.tiers.memory is None
        assert any("the memory tier is off: the ranks run on several hosts" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        train(ddp, opt, ck, 3, rank)
        ck.close()
        print(f"rank {rank}: ok", flush=True)
        return
    ddp, opt = build()
    ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=3, memory="auto", memory_dir=shm)
    train(ddp, opt, ck, 6, rank)
    at_6 = snapshot(ddp, opt)
    root = memory_tier.root_of(ck.config.directory, shm)
    copy = os.path.join(root, "step-000000006")
    assert sorted(os.listdir(copy)) == ["data.safetensors", "manifest.json", "rank-00000",
                                        "rank-00001"], os.listdir(copy)
    restored, got, said = load(directory, shm)
    assert restored.path == copy and not said, (restored.path, said)
    assert_same(got, at_6)
    dist.barrier()
    if rank == 1:  # one byte of rank 1's share in memory: every rank loads the disk's
        part = os.path.join(copy, "rank-00001")
        held = storage.read_manifest(part)["tensors"]
        flip_byte(part, max(held, key=lambda name: held[name]["nbytes"]))
    dist.barrier()
    restored, got, said = load(directory, shm)
    assert restored.path == os.path.join(ck.config.directory, "step-000000006"), restored.path
    assert any("does not verify" in w and "loading" in w and "from disk" in w for w in said), said
    assert_same(got, at_6)
    ck.close()
    dist.barrier()
    assert not os.path.exists(root), "close() removes the copies"
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
