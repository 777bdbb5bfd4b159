"""The DeepSpeed acceptance cases, shared by tests/integrations/test_deepspeed.py (CPU
accelerator) and tests/gpu/test_gpu_deepspeed.py (a CUDA engine): each trains a tiny model in
fresh processes (tests/_support/deepspeed_worker.py) uninterrupted, patched with a checkpoint,
and resumed from it, and compares bit patterns.  ``check_export_to_deepspeed`` (for
tests/integrations/test_deepspeed_export.py): the checkpoint exported in DeepSpeed's own
layout, loaded by DeepSpeed without gockpt.

The uninterrupted "plain" run (DeepSpeed without gockpt) is the same for every case of one
training scenario, whatever gockpt's options: :func:`runs` runs it once per session and
scenario (see ``PLAIN_KEYS``)."""

import copy
import json
import math
import os

import torch

import gockpt
from gockpt import storage
from gockpt.storage.commit import read_latest
from gockpt.storage.manifest import parse
from gockpt.storage.manifest_file import read_manifest
from tests._support.dist_ranks import run_ranks

WORKER = "deepspeed_worker"  # a module of tests._support
# Saves at 6, 12, 18: the first two are copied at once (nothing announced them); from their
# spacing the third is expected, and the replay modes copy it over the K steps up to 18.
SAVES, STEPS = [6, 12, 18], 21
SAVE_AT = SAVES[-1]


# What the worker's "plain" run (DeepSpeed alone: gockpt's install() not called) reads of the
# scenario: the DeepSpeed config and training ("gas", "clip", "betas", "torch_adam", "fp16",
# "fp32_accumulation", "two_groups", "stage"), the batches ("steps", "inf_at") and the step of
# its "live" snapshot (the last of "save_at").  Not "options" (install()'s), "gockpt_section"
# (a "gockpt" key of the DeepSpeed config that only gockpt's patch reads), "exit_without_wait",
# "load_dir", "resave_at", "resave_dir" (other runs').
PLAIN_KEYS = ("stage", "steps", "gas", "clip", "betas", "torch_adam", "fp16", "fp32_accumulation",
              "two_groups", "inf_at")
_plain_results = {}  # plain_key(...) -> the ranks' results, for the whole session


def plain_key(world, scenario):
    """The cache key of the "plain" run of ``scenario`` on ``world`` ranks."""
    saves = scenario.get("save_at")
    last = saves[-1] if isinstance(saves, list) else saves
    return json.dumps([world, last, os.environ.get("DS_ACCELERATOR"),
                       {k: scenario[k] for k in PLAIN_KEYS if k in scenario}], sort_keys=True)


def runs(tmp_path, world, **scenario):
    def one(run, **more):
        sc = dict(scenario, run=run, **more)
        key = plain_key(world, sc) if run == "plain" else None
        if key in _plain_results:  # the same training already ran uninterrupted this session
            return copy.deepcopy(_plain_results[key])
        run_ranks(tmp_path, json.dumps(sc), world=world, worker=WORKER, timeout=600)
        results = [torch.load(tmp_path / f"{run}-rank{r}.pt") for r in range(world)]
        if key is not None:
            _plain_results[key] = copy.deepcopy(results)
        return results
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
    assert read_latest(str(tmp_path / "ckpt"))[0] == f"step-{final:09d}"
    if world > 1:
        assert_each_replicated_byte_once(tmp_path / "ckpt", stage)
    assert_fp32_export_matches(tmp_path, saved[0]["live"])
    records = gockpt.metrics.read(str(tmp_path / "ckpt"), rank=0)
    assert [m["final_step"] for m in records] == SAVES
    k = extra.get("options", {}).get("overlap_steps", 1)
    # the third one was expected from the spacing; with "early" every one (the Checkpointer
    # made with the engine, the interval given)
    assert [m["overlap_steps"] for m in records] == ([k] * 3 if extra.get("early") else [1, 1, k])
    if transport is not None:  # the replay modes: how the replayed gradients crossed
        assert records[-1]["grad_transport"] == transport
        assert records[-1]["grad_steps"] == k - 1


def assert_each_replicated_byte_once(directory, stage):
    """The latest checkpoint in ``directory`` of several data-parallel ranks holds what they
    hold alike once (the module's weights; under ZeRO 0 everything, as shares) and each ZeRO
    1/2 fp32 partition as its rank's slice of the flat group, as the global index says."""
    path = storage.resolve(str(directory))
    top = read_manifest(path)
    assert top["shares"] is True
    held = {}
    for name in top["ranks"]:
        m = parse(os.path.join(path, name), read_manifest(os.path.join(path, name)))
        for param, ref in m.model.params.items():
            n = ref.extent[1] - ref.extent[0] if ref.extent else math.prod(m.logical_shape(ref))
            held[param] = held.get(param, 0) + n
    index = top["index"]
    assert held == {name: math.prod(e["shape"]) for name, e in index.items()}, (held, index)
    for name, e in index.items():
        partitioned = stage > 0 and name.startswith("master_")
        assert ("slices" if partitioned else "shares") in e, (name, e)


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


def check_export_to_deepspeed(tmp_path, stage, world, extra, save_at, steps,
                              against="uninterrupted"):
    """``gockpt export --to deepspeed`` (without ``--ds-config``: the DeepSpeed config the
    checkpoint recorded) of the patched run's checkpoint at ``save_at``: the files are those
    DeepSpeed's own ``save_checkpoint`` writes at that step (same names, keys, types and bits,
    ``ds_config`` included), and a DeepSpeed without gockpt (tests/_support/deepspeed_worker.py
    "plain-load") loads them in fresh processes and trains on bit for bit -- like the
    uninterrupted run (``against="uninterrupted"``), or like DeepSpeed's own checkpoint of that
    step loaded the same way (``"native-load"``: where DeepSpeed's own resume is not bitwise,
    see tests/integrations/test_deepspeed_export.py).  Returns the export directory (and leaves
    DeepSpeed's ``ds_config`` in ``tmp_path/ds_config.json``)."""
    from gockpt.cli import main
    scenario = dict(stage=stage, steps=steps, save_at=save_at, **extra)
    for d in ("native", "gockpt", "load", "native-load"):
        (tmp_path / d).mkdir()
    native = runs(tmp_path / "native", world, **scenario)("native-save")  # plain DeepSpeed
    saved = runs(tmp_path / "gockpt", world, **scenario)("save")
    # (the config the run trained with, as DeepSpeed kept it: for the callers' --ds-config)
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(torch.load(
        next((tmp_path / "native" / "ckpt").glob("*/mp_rank_00_model_states.pt")),
        weights_only=False, map_location="cpu")["ds_config"]))
    out = tmp_path / "export"
    # Without --ds-config: the config gockpt recorded, written as DeepSpeed writes its own
    # (ds_config in every file, compared below with DeepSpeed's)
    assert main(["export", str(tmp_path / "gockpt" / "ckpt"), "--to", "deepspeed",
                 str(out)]) == 0
    assert_same_deepspeed_checkpoint(tmp_path / "native" / "ckpt", out)
    loaded = runs(tmp_path / "load", world, **scenario, load_dir=str(out))("plain-load")
    reference = native if against == "uninterrupted" else runs(
        tmp_path / "native-load", world, **scenario,
        load_dir=str(tmp_path / "native" / "ckpt"))("plain-load")
    first = save_at * extra.get("gas", 1) if against == "uninterrupted" else 0
    for r in range(world):
        assert_states_equal(loaded[r]["loaded"], saved[r]["live"], f"rank {r}: loaded vs live")
        assert loaded[r]["client"]["data_pos"] == save_at and loaded[r]["client"]["rank"] == 0
        assert loaded[r]["losses"] == reference[r]["losses"][first:], f"rank {r}: losses"
        assert_states_equal(loaded[r]["final"], reference[r]["final"], f"rank {r}: vs {against}")
    return out


def assert_same_deepspeed_checkpoint(native, export):
    """Two DeepSpeed checkpoint directories hold the same files, and each file the same
    objects: keys in the same order, the same types (DeepSpeed's loss scaler, enums, fragment
    addresses included, compared by their attributes), tensors of the same dtype, shape and
    bits.  (Not the module dict's ``_metadata``, which the export leaves out: see
    gockpt/integrations/deepspeed/export.py.)"""
    tag = (native / "latest").read_text().strip()
    assert (export / "latest").read_text().strip() == tag
    assert sorted(p.name for p in native.iterdir()) == sorted(p.name for p in export.iterdir())
    names = sorted(p.name for p in (native / tag).iterdir())
    assert sorted(p.name for p in (export / tag).iterdir()) == names
    problems = []
    for name in names:
        a, b = (torch.load(d / tag / name, weights_only=False, map_location="cpu")
                for d in (native, export))
        _differences(a, b, name, problems)
    assert not problems, "the export is not DeepSpeed's own checkpoint:\n" + "\n".join(problems)


def _differences(a, b, where, out):
    if type(a) is not type(b):
        out.append(f"{where}: {type(a).__name__} here, {type(b).__name__} in the export")
    elif torch.is_tensor(a):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            out.append(f"{where}: tensor {a.dtype} {tuple(a.shape)} differs from the export's "
                       f"{b.dtype} {tuple(b.shape)}")
    elif isinstance(a, dict):
        if list(a) != list(b):
            out.append(f"{where}: keys {list(a)}, the export's {list(b)}")
        for k in a.keys() & b.keys():
            _differences(a[k], b[k], f"{where}[{k!r}]", out)
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} items, the export's {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{where}[{i}]", out)
    elif hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's objects
        _differences(vars(a), vars(b), f"{where}.__dict__", out)
    elif a != b:
        out.append(f"{where}: {a!r}, the export's {b!r}")
