"""One rank of the docs' examples that need ranks of their own (tests/test_docs_examples.py,
started by tests/_support/dist_ranks.py: DeepSpeed and FSDP2 set up torch.distributed, which
the test process itself must not), run in DIRECTORY as the example is written.

    python -m tests._support.docs_worker DIRECTORY SCENARIO    SCENARIO: JSON, one of
        {"run": "save", "kind": "fsdp2" | "ddp"}   train 4 steps with gockpt-o on the ranks
            and checkpoint step 4 into checkpoints/run1 (the model: :func:`build_model`); the
            whole model state at step 4 goes to saved-model.pt
        {"run": "example", "page": ..., "index": ...}   the example, with the names it assumes
            (:data:`NAMES`), then what it must have done (:data:`CHECKS`)

Prints ``rank R: ok`` when it is done.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

SAVED_AT = 4


class Net(nn.Module):
    """A model as the resharding examples build it: its blocks in ``layers``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh())
                                    for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model() -> Net:
    torch.manual_seed(0)
    return Net()


def whole_state(model: nn.Module) -> dict:
    """The model's state dict with FSDP2's shards put together (a collective then)."""
    model = getattr(model, "module", model)  # (DDP's inner)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in model.state_dict().items()}


def save(kind: str) -> None:
    import gockpt
    from torch.distributed.fsdp import fully_shard
    model = build_model()
    if kind == "fsdp2":
        for layer in model.layers:
            fully_shard(layer)
        trained = fully_shard(model)
    else:
        trained = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
    ck = gockpt.Checkpointer(trained, optimizer, "checkpoints/run1", mode="gockpt-o",
                             overlap_steps=2, interval=SAVED_AT, scheduler=scheduler)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(SAVED_AT):
        loss = trained(torch.randn(8, 32, generator=g)).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        ck.save_checkpoint(step + 1)
    ck.close()
    state = whole_state(trained)
    if dist.get_rank() == 0:
        torch.save(state, "saved-model.pt")


def _fsdp2_names() -> dict:
    import gockpt
    from torch.distributed.fsdp import fully_shard
    return {"torch": torch, "gockpt": gockpt, "build_model": build_model,
            "fully_shard": fully_shard}


def _deepspeed_names() -> dict:
    """A DeepSpeed script's names: tests/_support/deepspeed_worker.py's model and its ZeRO 1
    config, 30 batches of its shapes."""
    import deepspeed

    from tests._support.deepspeed_worker import config_of, model_of
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(4, 16, generator=g).bfloat16(), torch.randn(4, 4, generator=g))
              for _ in range(30)]
    return {"deepspeed": deepspeed, "torch": torch, "model": model_of({}),
            "ds_config": config_of({"stage": 1}), "loader": loader,
            "save_dir": "checkpoints/ds_run"}


def _zero2_names() -> dict:
    """What resuming tests/_support/deepspeed_worker.py's ZeRO 1 "save" run with ZeRO 2 takes."""
    import deepspeed

    from gockpt.integrations import deepspeed as gockpt_ds
    from tests._support.deepspeed_worker import config_of, model_of
    return {"deepspeed": deepspeed, "gockpt_ds": gockpt_ds, "model": model_of({}),
            "config_with_zero_stage_2": config_of({"stage": 2})}


def _trained_and_saved(ns) -> None:
    import gockpt
    gockpt.integrations.deepspeed.wait(ns["engine"])
    assert ns["client_state"] == {"data_pos": 30}, ns["client_state"]
    assert ns["engine"].global_steps == 30
    assert os.path.realpath(ns["load_path"]).startswith(os.path.realpath("checkpoints/ds_run"))
    saved = gockpt.storage.list_checkpoints("checkpoints/ds_run")
    assert saved == [f"step-{s:09d}" for s in (10, 20, 30)], saved
    assert gockpt.verify("checkpoints/ds_run").ok


def _resharded_into_fsdp2(ns) -> None:
    assert ns["restored"].step == SAVED_AT and ns["restored"].resharded
    state, saved = whole_state(ns["model"]), torch.load("saved-model.pt")
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def _resumed_with_zero2(ns) -> None:
    """The engine at the saved step, its module's weights those the saving ranks had (their
    live state at the save, written by tests/_support/deepspeed_worker.py to saved/)."""
    from gockpt.integrations.deepspeed.state import EngineState
    assert ns["client_state"]["data_pos"] == SAVED_AT, ns["client_state"]
    assert ns["engine"].global_steps == SAVED_AT
    saved = torch.load("saved/save-rank0.pt")["live"]["tensors"]
    weights = {k: v for k, v in EngineState(ns["engine"]).state_dict().items()
               if k.startswith("module.")}
    assert weights and weights.keys() == {k for k in saved if k.startswith("module.")}
    assert all(torch.equal(v, saved[k]) for k, v in weights.items())


DEEPSPEED = {("docs/deepspeed.md", 0), ("docs/resharding.md", 3)}
NAMES = {("docs/deepspeed.md", 0): _deepspeed_names,
         ("docs/resharding.md", 2): _fsdp2_names,
         ("docs/resharding.md", 3): _zero2_names}
CHECKS = {("docs/deepspeed.md", 0): _trained_and_saved,
          ("docs/resharding.md", 2): _resharded_into_fsdp2,
          ("docs/resharding.md", 3): _resumed_with_zero2}


def main():
    # (here, not at import: the docs test imports build_model, and a LOCAL_RANK in its own
    # environment would make Accelerate and the Trainer there set up torch.distributed)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    directory, sc = sys.argv[1], json.loads(sys.argv[2])
    os.chdir(directory)
    if sc["run"] == "save":
        dist.init_process_group("gloo")
        save(sc["kind"])
    else:
        from tests._support.docs_blocks import blocks
        key = (sc["page"], sc["index"])
        if key not in DEEPSPEED:  # (deepspeed.initialize sets up its own)
            dist.init_process_group("gloo")
        ns = NAMES[key]()
        exec(compile(blocks()[key], f"{key[0]}:example {key[1]}", "exec"), ns)
        CHECKS[key](ns)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        dist.destroy_process_group()  # (gloo's threads done before the interpreter ends)
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
