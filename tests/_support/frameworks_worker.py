"""One rank of tests/test_frameworks.py (started by tests/_support/dist_ranks.py): the
frameworks users wrap their models in, on real gloo ranks. Exits non-zero on any mismatch."""

import sys

import torch
import torch.distributed as dist
from torch import nn

import gockpt
import gockpt.testing


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_and_save(model, opt, ck, rank: int, steps: int, save_at: int) -> dict:
    """Train ``steps`` steps on this rank's data, force a checkpoint at ``save_at``; the
    snapshot of ``model`` (unwrapped) at the checkpoint's final step."""
    gen = torch.Generator().manual_seed(1000 + rank)
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else \
        getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    handles, at_f = [], {}
    for step in range(steps):
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        h = ck.save_checkpoint(step + 1, force=step + 1 == save_at)
        handles += [h] if h is not None else []
        if any(step + 1 == x.final_step for x in handles):
            at_f = gockpt.testing.snapshot(net, opt)
    ck.close()
    return at_f


def ddp_save(directory: str, rank: int) -> None:
    """A DDP-wrapped model checkpointed on every rank: stored names without 'module.', the
    checkpoint recorded as replicated; rank 0 leaves the state at F for the test."""
    model, _ = tiny()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    ck = gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o", overlap_steps=2,
                             block_bytes=256)
    at_f = train_and_save(ddp, opt, ck, rank, 6, 3)
    if rank == 0:
        torch.save(at_f, directory + ".expected.pt")


def load_into_ddp(directory: str, rank: int) -> None:
    """A checkpoint written by one rank from an unwrapped model: refused into a plain model on
    two ranks (per-rank state would be guessed), loaded into a DDP replica on each rank."""
    expected = torch.load(directory + ".expected.pt", weights_only=True)
    model, opt = tiny(seed=7)
    try:
        gockpt.load(directory, model, opt, restore_rng=False)
    except gockpt.LoadError as exc:
        assert "written by 1 rank and holds per-rank state; this job has 2" in str(exc), exc
    else:
        raise AssertionError("a 1-rank checkpoint was loaded on 2 ranks into a plain model")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    gockpt.load(directory, ddp, opt, restore_rng=False)
    got = gockpt.testing.snapshot(model, opt)
    for key in ("model", "optimizer"):
        why = gockpt.testing.first_difference(expected[key], got[key], key)
        assert why is None, why


def per_rank_save(directory: str, rank: int) -> None:
    """Every rank its own state (no data parallelism): a checkpoint of per-rank parts."""
    model, opt = tiny(seed=100 + rank)
    ck = gockpt.Checkpointer(model, opt, directory, mode="sync")
    at_f = train_and_save(model, opt, ck, rank, 3, 2)
    torch.save(at_f, directory + f".expected-{rank}.pt")


SCENARIOS = {"ddp-save": ddp_save,
             "load-into-ddp": load_into_ddp, "per-rank-save": per_rank_save}


def main():
    directory, scenario = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    SCENARIOS[scenario](directory, rank)
    dist.barrier()
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
