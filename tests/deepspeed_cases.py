"""The DeepSpeed acceptance cases, shared by tests/integrations/test_deepspeed.py (CPU
accelerator) and tests/gpu/test_gpu_deepspeed.py (a CUDA engine): each trains a tiny model in
fresh processes (tests/deepspeed_worker.py) uninterrupted, patched with a checkpoint, and
resumed from it, and compares bit patterns."""

import json
import os

import torch

import gockpt
from dist_ranks import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_worker.py")
# Saves at 6, 12, 18: the first two are copied at once (nothing announced them); from their
# spacing the third is expected, and the replay modes copy it over the K steps up to 18.
SAVES, STEPS = [6, 12, 18], 21
SAVE_AT = SAVES[-1]


def runs(tmp_path, world, **scenario):
    def one(run, **more):
        run_ranks(tmp_path, json.dumps(dict(scenario, run=run, **more)), world=world,
                  worker=WORKER, timeout=600)
        return [torch.load(tmp_path / f"{run}-rank{r}.pt") for r in range(world)]
    return one


def assert_states_equal(a, b, what):
    assert a["tensors"].keys() == b["tensors"].keys() and a["optimizer"].keys() == b["optimizer"].keys()
    for part in ("tensors", "optimizer"):
        for name, t in a[part].items():
            assert t.dtype == b[part][name].dtype and torch.equal(t.view(-1).view(torch.uint8),
                                                                  b[part][name].view(-1).view(torch.uint8)), \
                f"{what}: {part} {name} differs"
    assert a["counters"] == b["counters"], what


def check_checkpoint_and_resume(tmp_path, stage, world, extra, transport=None):
    """Plain, patched-with-checkpoints and resumed runs of one scenario: no interference, the
    checkpoint is the live state at the step saved (with the client_state given there), the
    resume goes on bit for bit, the fp32 export and (``transport`` given) how the replayed
    gradients crossed, from the metrics."""
    final = SAVE_AT
    one = runs(tmp_path, world, stage=stage, steps=STEPS, save_at=SAVES, **extra)
    plain, saved, resumed = one("plain"), one("save"), one("resume")
    for r in range(world):
        # No interference: the patched run with its checkpoint trains exactly like the plain one.
        assert saved[r]["losses"] == plain[r]["losses"]
        assert_states_equal(saved[r]["final"], plain[r]["final"], f"rank {r}: patched vs plain")
        # The checkpoint is the live state at F (fp32 master, moments, step, weights, counters).
        assert_states_equal(resumed[r]["loaded"], saved[r]["live"], f"rank {r}: loaded vs live")
        assert resumed[r]["client"] == {"data_pos": final, "rank": r}
        # Resumed in fresh processes, training goes on bit for bit.
        gas = extra.get("gas", 1)
        assert resumed[r]["losses"] == plain[r]["losses"][final * gas:]
        assert_states_equal(resumed[r]["final"], plain[r]["final"], f"rank {r}: resumed vs plain")
    assert open(tmp_path / "ckpt" / "latest").read().strip() == f"step-{final:09d}"
    assert_fp32_export_matches(tmp_path, saved[0]["live"])
    records = gockpt.metrics.read(str(tmp_path / "ckpt"))
    assert [m["final_step"] for m in records] == SAVES
    k = extra.get("options", {}).get("overlap_steps", 1)
    assert [m["overlap_steps"] for m in records] == [1, 1, k]  # the third one was expected
    if transport is not None:  # the replay modes: how the replayed gradients crossed
        assert records[-1]["grad_transport"] == transport
        assert records[-1]["grad_steps"] == k - 1


def assert_fp32_export_matches(tmp_path, live):
    """``gockpt export --to fp32``: every parameter whole, in fp32, and (DeepSpeed's weights
    being the bf16 rounding of the master) rounding to the module's weights at F."""
    from gockpt.cli import main
    from safetensors.torch import load_file
    out = tmp_path / "fp32.safetensors"
    assert main(["export", str(tmp_path / "ckpt"), "--to", "fp32", str(out)]) == 0
    fp32 = load_file(str(out))
    weights = {k[len("module."):]: v for k, v in live["tensors"].items()
               if k.startswith("module.")}
    assert fp32.keys() == weights.keys()
    for name, t in fp32.items():
        assert t.dtype == torch.float32 and t.shape == weights[name].shape
        assert torch.equal(t.to(weights[name].dtype), weights[name].cpu()), name
