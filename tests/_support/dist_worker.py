"""One rank of tests/storage/test_storage_ranks.py (started by tests/_support/dist_ranks.py):
trains its own model (seeded by rank), checkpoints with gockpt-o together with the other ranks,
and checks what it loads. Exits non-zero on any mismatch."""

import os
import sys

import torch.distributed as dist

import gockpt
from gockpt import storage
from tests._support import harness as H


class FailingPart(storage.CheckpointWriter):
    """The storage plugin of every rank; armed on rank 1 only."""

    armed = False

    def write_tensors(self, tensors):
        if not FailingPart.armed:
            return super().write_tensors(tensors)
        raise OSError(28, "No space left on device (injected on one rank)")


def main():
    directory, scenario = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    H.seed_all(100 + rank)  # every rank has different state: its part must be its own
    model, opt, sched = H.build(seed=100 + rank)
    ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=2,
                             scheduler=sched, block_bytes=512, self_check=1.0,
                             storage_writer=FailingPart)
    snaps, handles = {}, []

    def on_boundary(step, h):
        if h is not None:
            handles.append(h)
        if any(step == x.final_step for x in handles):
            snaps[step] = H.snapshot(model, opt, sched)

    H.train_steps(model, opt, sched, 0, 6, ck, at={4}, on_boundary=on_boundary)
    ck.wait()
    first = handles[0]
    assert os.path.basename(storage.resolve(directory)) == "step-000000004"
    if scenario == "named":
        return named(directory, rank, ck, model, opt, sched)
    if scenario == "one-rank-fails":
        if rank == 1:
            FailingPart.armed = True  # the part writer of rank 1 fails
        try:
            H.train_steps(model, opt, sched, 6, 10, ck, at={8}, on_boundary=on_boundary)
            ck.wait()
        except gockpt.CheckpointFailedError as exc:
            print(f"rank {rank}: failed as expected: {exc}", flush=True)
        else:
            raise AssertionError("the checkpoint missing a rank was not reported as failed")
        dist.barrier()
        # never latest, never visible
        assert os.path.basename(storage.resolve(directory)) == "step-000000004"
        assert storage.list_checkpoints(directory) == ["step-000000004"]
    ck.close()
    dist.barrier()
    m2, o2, s2 = H.build(seed=7)
    restored = gockpt.load(directory, m2, o2, scheduler=s2)
    assert restored.step == first.final_step == 4
    H.assert_same(snaps[4], H.snapshot(m2, o2, s2), f"rank {rank}")
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


def named(directory, rank, ck, model, opt, sched):
    """Whether a save may take a name is rank 0's answer on every rank: rank 1 would refuse
    any (as a stale view of the directory might), and yet both save ``global_step8``; a name
    rank 0 refuses (a directory without a manifest) raises ConfigError on both, neither
    left waiting."""
    import gockpt.storage.ranks as ranks_mod
    if rank == 1:
        def refuse(root, name):
            raise gockpt.ConfigError(f"rank 1's own view refuses {name!r}")
        ranks_mod.check_step_name = refuse
    H.train_steps(model, opt, sched, 6, 8, ck, names={8: "global_step8"})
    ck.wait()
    assert os.path.basename(storage.resolve(directory)) == "global_step8"
    if rank == 0:
        os.makedirs(os.path.join(directory, "global_step10"))
    dist.barrier()
    try:
        ck.save_checkpoint(8, name="global_step10")
    except gockpt.ConfigError as exc:
        want = "not a committed checkpoint" if rank == 0 else "rank 0 refused"
        assert want in str(exc), exc
    else:
        raise AssertionError("a name rank 0 refused was taken")
    ck.close()
    dist.barrier()
    print(f"rank {rank}: ok (named)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
