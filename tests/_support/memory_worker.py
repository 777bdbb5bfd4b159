"""One rank of tests/test_memory_tier.py's jobs of several ranks (started by
tests/_support/dist_ranks.py): DDP replicas, whose checkpoint is written in shares (a load reads
every rank's part), with the memory tier in ``GOCKPT_TEST_SHM``. Exits non-zero on any
mismatch.

Scenarios: ``load`` -- the memory copy is a whole checkpoint of every rank, loaded bitwise on
every rank; one byte of rank 1's part damaged in memory makes every rank load the disk's (a
warning on each); close() removes the copies. ``hosts`` -- ranks declared on two hosts, each
host's copy holding its peers' parts: :func:`hosts_scenario`; ``ring`` -- FSDP2 on 3 hosts:
:func:`ring_scenario`. ``log`` -- :func:`log_scenario`;
``fsdp2log`` -- the same with the model sharded by FSDP2 (each rank logs and replays its
shards)."""

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
from gockpt.storage import memory_tier, peers
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
        log_scenario(directory, shm, rank, build if scenario == "log" else build_fsdp2)
    elif scenario == "hosts":
        hosts_scenario(directory, rank)
    elif scenario == "hosts-restart":
        hosts_restart_scenario(directory, rank)
    elif scenario == "ring":
        ring_scenario(directory, rank)
    else:
        load_scenario(directory, shm, rank)
    leave()


def leave(crash=False):
    """Every rank done with the default group before any process ends (a rank leaving while
    another still completes the last collective fails it: "Connection closed by peer");
    ``crash``: end at once, nothing closed (the memory copies stay)."""
    dist.barrier()
    dist.destroy_process_group()
    if crash:
        os._exit(0)


def load_scenario(directory, shm, rank):
    """``load``: the module docstring."""
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


def on_host(rank, per_host=2):
    """Rank ``rank`` declared on host ``rank // per_host``, its memory in a directory of that
    host's: (host, memory_dir)."""
    host = rank // per_host
    os.environ["GOCKPT_HOST"] = f"host-{host}"
    mine = os.path.join(os.environ["GOCKPT_TEST_SHM"], f"host-{host}")
    os.makedirs(mine, exist_ok=True)
    return host, mine


def lose_host_1(directory, rank, damage=None, deleter=2):
    """Host 1's memory lost (rank ``deleter``, one of its ranks, deletes it for all of them);
    ``damage``: a part on host 0 whose largest tensor rank 0 damages meanwhile."""
    dist.barrier()
    if rank == deleter:
        shutil.rmtree(memory_tier.root_of(directory, os.path.join(os.environ["GOCKPT_TEST_SHM"],
                                                                   "host-1")))
    if rank == 0 and damage:
        held = storage.read_manifest(damage)["tensors"]
        flip_byte(damage, max(held, key=lambda name: held[name]["nbytes"]))
    dist.barrier()


PARTS = ["data.safetensors", "manifest.json"] + [f"rank-{r:05d}" for r in range(4)]


def hosts_scenario(directory, rank):
    """4 ranks declared on 2 hosts (2 each), each host's memory in a directory of its own:
    each host's copy holds its own ranks' parts and those it keeps for the other host's
    (here: every part). The memory of host 1 lost: its ranks take their parts from their
    peers on host 0 and load bitwise, and the next checkpoint is kept on both hosts again.
    Host 1's memory lost again and the part host 0 keeps for rank 2 damaged: every rank loads
    the disk's; and so it does when host 1's memory is lost and host 0 lacks that part. Then a checkpoint of step 12, and every rank dies (no close(): the copies
    stay) -- :func:`hosts_restart_scenario` goes on."""
    host, mine = on_host(rank)
    ddp, opt = build()
    ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=3, memory="auto", memory_dir=mine)
    assert ck.tiers.memory is not None
    directory = ck.config.directory
    train(ddp, opt, ck, 6, rank)
    at_6 = snapshot(ddp, opt)
    root = memory_tier.root_of(directory, mine)
    copy = os.path.join(root, "step-000000006")
    assert sorted(os.listdir(copy)) == PARTS, os.listdir(copy)
    restored, got, said = load(directory, mine)
    assert restored.path == copy and not said, (restored.path, said)
    assert_same(got, at_6)

    lose_host_1(directory, rank)
    restored, got, said = load(directory, mine)
    received = os.path.join(root, "peers", f"rank-{rank:05d}", "step-000000006")
    assert restored.path == (received if host == 1 else copy) and not said, (restored.path, said)
    assert sorted(os.listdir(received if host == 1 else copy)) == PARTS
    assert_same(got, at_6)
    for s in range(6, 9):  # the next checkpoint: on both hosts, the received parts dropped
        step(ddp, opt, ck, s, rank)
    ck.wait()
    dist.barrier()  # (each host's lowest rank has dropped what it holds no more)
    at_9 = snapshot(ddp, opt)
    copy = os.path.join(root, "step-000000009")
    assert sorted(os.listdir(root)) == ["latest", "run", "step-000000009"], os.listdir(root)
    assert sorted(os.listdir(copy)) == PARTS, os.listdir(copy)

    lose_host_1(directory, rank, damage=os.path.join(copy, "rank-00002"))
    restored, got, said = load(directory, mine)
    assert restored.path == os.path.join(directory, "step-000000009"), restored.path
    assert any("does not verify" in w and "from disk" in w for w in said), said
    assert_same(got, at_9)

    # Host 1's memory lost once more, and host 0's copy without rank 2's part at all: a part
    # that neither its host nor its peer keeps -- every rank reads it under DDP's shares, so
    # every rank loads the disk's (the swap goes on with nothing to send, nobody raises)
    lose_host_1(directory, rank)
    if rank == 0:
        shutil.rmtree(os.path.join(copy, "rank-00002"))
    dist.barrier()
    restored, got, said = load(directory, mine)
    assert restored.path == os.path.join(directory, "step-000000009"), (restored.path, said)
    assert not os.path.exists(os.path.join(root, "peers", f"rank-{rank:05d}", "step-000000009"))
    assert_same(got, at_9)
    for s in range(9, 12):
        step(ddp, opt, ck, s, rank)
    ck.wait()
    assert sorted(os.listdir(os.path.join(root, "step-000000012"))) == PARTS
    print(f"rank {rank}: ok", flush=True)
    leave(crash=True)  # every rank dies: nothing closed, the copies stay


def ring_scenario(directory, rank):
    """FSDP2 on 3 ranks, each on a host of its own: each rank's part is kept by the next
    rank (the last's by rank 0), so each host holds its own part and the previous rank's, and
    a rank reads only its own. Host 1's memory lost: rank 1 takes its part from rank 2 and
    every rank loads bitwise (rank 0 and 2 from their own host's copy). Then the part rank 0
    keeps for rank 2 cannot be written: no host keeps that checkpoint (a warning on every
    rank), and a load takes the disk's, bitwise."""
    _, mine = on_host(rank, per_host=1)
    model, opt = build_fsdp2()
    ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=3, memory="auto", memory_dir=mine)
    directory = ck.config.directory
    train(model, opt, ck, 6, rank)
    at_6 = snapshot(model, opt)
    root = memory_tier.root_of(directory, mine)
    copy = os.path.join(root, "step-000000006")
    held = sorted(p for p in os.listdir(copy) if p.startswith("rank-"))
    assert held == sorted({f"rank-{rank:05d}", f"rank-{(rank - 1) % 3:05d}"}), held
    lose_host_1(directory, rank, deleter=1)
    restored, got, said = load(directory, mine, build_fsdp2)
    received = os.path.join(root, "peers", f"rank-{rank:05d}", "step-000000006")
    assert restored.path == (received if rank == 1 else copy) and not said, (restored.path, said)
    assert_same(got, at_6)
    if rank == 0:  # the part it keeps for rank 2 cannot be written: no host keeps step 9
        def refuse(*args):
            raise OSError(28, "No space left on device")
        peers.write_files = refuse
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(6, 9):
            step(model, opt, ck, s, rank)
        ck.wait()
    said = [str(w.message) for w in caught]
    assert any("checkpoint step-000000009 not kept in memory" in w for w in said), said
    at_9 = snapshot(model, opt)
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "step-000000009")), os.listdir(root)
    restored, got, said = load(directory, mine, build_fsdp2)
    assert restored.path == os.path.join(directory, "step-000000009") and not said, said
    assert_same(got, at_9)
    ck.close()
    dist.barrier()
    assert not os.path.exists(root), "close() removes each host's copies"
    print(f"rank {rank}: ok", flush=True)


def hosts_restart_scenario(directory, rank):
    """Fresh processes after :func:`hosts_scenario`, host 1's memory lost before they start:
    its ranks load step 12 from their peers' memory, the others from their host's, every
    rank bitwise the disk's checkpoint; the training goes on and its next checkpoint is kept
    on both hosts; close() removes each host's copies."""
    host, mine = on_host(rank)
    directory = os.path.realpath(directory)
    lose_host_1(directory, rank)
    ddp, opt = build()
    gockpt.load(directory, ddp, opt, tag="step-000000012")
    from_disk = snapshot(ddp, opt)
    restored, got, said = load(directory, mine)
    root = memory_tier.root_of(directory, mine)
    assert restored.path == os.path.join(root, *(("peers", f"rank-{rank:05d}") if host == 1
                                                 else ()), "step-000000012"), restored.path
    assert restored.step == 12 and not said, said
    assert_same(got, from_disk)
    ddp, opt = build()
    gockpt.load(directory, ddp, opt, memory_dir=mine)
    ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=2,
                             interval=3, memory="auto", memory_dir=mine)
    for s in range(12, 15):
        step(ddp, opt, ck, s, rank)
    ck.wait()
    dist.barrier()  # (each host's lowest rank has dropped what it holds no more)
    assert sorted(os.listdir(root)) == ["latest", "run", "step-000000015"], os.listdir(root)
    assert sorted(os.listdir(os.path.join(root, "step-000000015"))) == PARTS
    dist.barrier()  # (every rank has looked before the host's lowest rank removes them)
    ck.close()
    dist.barrier()
    assert not os.path.exists(root), "close() removes each host's copies"
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
