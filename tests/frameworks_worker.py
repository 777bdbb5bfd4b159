"""One rank of tests/test_frameworks.py (started by tests/dist_ranks.py): the frameworks users
wrap their models in, on real gloo ranks. Exits non-zero on any mismatch."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import gockpt  # noqa: E402


def fsdp2_refused(directory: str, rank: int) -> None:
    """FSDP2's DTensor parameters are refused at construction in every mode, nothing written."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for mode in gockpt.MODES:
        try:
            gockpt.Checkpointer(model, opt, directory, mode=mode, overlap_steps=None)
        except gockpt.UnsupportedTensorError as exc:
            assert "'0.weight' is a DTensor (FSDP2" in str(exc), str(exc)
            assert "torch.distributed.checkpoint" in str(exc), str(exc)
        else:
            raise AssertionError(f"mode {mode}: an FSDP2 model was accepted")
    assert not os.path.exists(os.path.join(directory, "latest"))


SCENARIOS = {"fsdp2-refused": fsdp2_refused}


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
