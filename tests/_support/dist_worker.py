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


if __name__ == "__main__":
    main()
