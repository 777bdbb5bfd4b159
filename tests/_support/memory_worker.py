"""One rank of tests/test_memory_tier.py's jobs of several ranks (started by
tests/_support/dist_ranks.py): DDP replicas, whose checkpoint is written in shares (a load reads
every rank's part), with the memory tier in ``GOCKPT_TEST_SHM``. Exits non-zero on any
mismatch.

Scenarios: ``load`` -- the memory copy is a whole checkpoint of every rank, loaded bitwise on
every rank; one byte of rank 1's part damaged in memory makes every rank load the disk's (a
warning on each); close() removes the copies. ``hosts`` -- ranks declared on two hosts: the tier is
off, with a warning, on every rank. ``log`` -- :func:`log_scenario`; ``fsdp2log`` -- the
same with the model sharded by FSDP2 (each rank logs and replays its shards)."""

import os
import shutil
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gockpt
from gockpt import storage
from gockpt.storage import memory_tier
from gockpt.storage.steplog import log_root
from gockpt.testing import assert_same, snapshot
from tests._support.cli_helpers import flip_byte
from tests._support.exit_worker import step


def build():
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)))
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def build_fsdp2():
    """The same model sharded by FSDP2 over the ranks (each layer, then the whole)."""
    from tests._support.ranks_worker import fsdp2
    torch.manual_seed(0)
    model = fsdp2(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(ddp, opt, ck, steps, rank):
    for s in range(steps):
        step(ddp, opt, ck, s, rank)
    ck.wait()


def load(directory, shm, make=build):
    ddp, opt = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = gockpt.load(directory, ddp, opt, memory_dir=shm)
    return restored, snapshot(ddp, opt), [str(w.message) for w in caught]


def main():
    directory, scenario = sys.argv[1], sys.argv[2]
    shm = os.environ["GOCKPT_TEST_SHM"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario in ("log", "fsdp2log"):
        return log_scenario(directory, shm, rank, build if scenario == "log" else build_fsdp2)
    if scenario == "hosts":
        ddp, opt = build()
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


def log_scenario(directory, shm, rank, make):
    """The step log on 2 ranks (DDP, or FSDP2 from ``make``): each rank logs its own steps
    (FSDP2: its shards'); a restart replays on every rank the steps every rank logged whole --
    rank 1's last entry missing: both resume at the step before it, bitwise; rank 0's first
    entry after the checkpoint damaged: both resume at the checkpoint (a warning on rank 0);
    a load that fails on one rank fails on both."""
    ddp, opt = make()
    ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=3, memory="auto", memory_dir=shm, memory_log=1 << 24)
    snaps = {}
    for s in range(8):  # checkpoints of steps 3 and 6, then the log's steps 7 and 8
        step(ddp, opt, ck, s, rank)
        snaps[s + 1] = snapshot(ddp, opt)
    ck.wait()
    ck.steplog._written.wait()  # (the entry of step 8 written: a crash after it)
    logs = log_root(memory_tier.root_of(ck.config.directory, shm))
    mine = os.path.join(logs, f"rank-{rank:05d}")
    assert sorted(os.listdir(mine)) == ["step-000000007", "step-000000008"], os.listdir(mine)
    dist.barrier()
    if rank == 1:  # its entry of step 8 never completed (a crash in its write)
        shutil.rmtree(os.path.join(mine, "step-000000008"))
    dist.barrier()
    restored, got, said = load(directory, shm, make)
    assert restored.step == 7 and not said, (restored.step, said)
    assert restored.path == os.path.join(mine, "step-000000007"), restored.path
    assert_same(got, snaps[7])
    dist.barrier()
    if rank == 0:  # one byte of rank 0's entry of step 7
        entry = os.path.join(mine, "step-000000007")
        held = storage.read_manifest(entry)["tensors"]
        flip_byte(entry, max(held, key=lambda name: held[name]["nbytes"]))
    dist.barrier()
    restored, got, said = load(directory, shm, make)
    assert restored.step == 6, restored.step
    assert any("is damaged" in w for w in said) == (rank == 0), said
    assert_same(got, snaps[6])
    # a load that fails on rank 1 alone (an optimizer the checkpoint does not fit) fails on
    # rank 0 too, which would otherwise wait in the log's gathers for rank 1 (was: a hang)
    ddp, opt = make()
    if rank == 1:
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    with pytest.raises(gockpt.LoadError) as failed:
        gockpt.load(directory, ddp, opt, memory_dir=shm)
    assert ("another rank could not load" in str(failed.value)) == (rank == 0), failed.value
    dist.barrier()
    ck.close()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
