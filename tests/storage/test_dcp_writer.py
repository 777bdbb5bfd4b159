"""gockpt.storage.dcp.GockptWriter: torch.distributed.checkpoint's save writes gockpt's format,
which gockpt verify, gockpt.load and the reader take -- in one process here; FSDP2 and DDP on
several ranks, loaded on another number of ranks, at the end."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

import gockpt
import gockpt.testing
from gockpt import storage
from gockpt.storage.commit import read_latest, write_latest
from gockpt.storage.dcp import GockptReader, GockptWriter
from tests._support.dist_ranks import run_ranks


def _trained(seed=0, steps=3):
    """A model, its AdamW in two param groups (the biases without weight decay) trained a
    few steps, and a torchtitan-style state dict of them for DCP."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(),
             "train_state": {"step": steps, "tokens": torch.tensor(4096 * steps)}}
    return model, opt, state


def _save(state, run, step, **kwargs):
    writer = GockptWriter(run, step=step, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def _dcp_load(path, state):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=GockptReader(path), no_dist=True)


def test_dcp_save_writes_a_gockpt_checkpoint_that_every_reader_takes_bitwise(tmp_path):
    run = str(tmp_path / "run")
    model, opt, state = _trained()
    writer = _save(state, run, 3)
    path = os.path.join(os.path.realpath(run), "step-000000003")
    assert writer.path == path and storage.resolve(run) == path  # committed, latest names it
    assert gockpt.verify(run).ok
    # back through DCP's own load and gockpt's reader: every value of the state dict
    _, _, fresh = _trained(seed=1, steps=1)
    _dcp_load(path, fresh)
    why = gockpt.testing.first_difference(state, fresh, "dcp.load of what dcp.save wrote")
    assert why is None, why
    # and through gockpt.load into a model and optimizer: parameters, moments, steps, groups
    model2, opt2, _ = _trained(seed=2, steps=1)
    with pytest.warns(UserWarning, match="keeps no RNG states"):
        restored = gockpt.load(run, model2, opt2)
    assert restored.step == 3 and restored.path == path and not restored.rng_restored
    why = gockpt.testing.first_difference(gockpt.testing.snapshot(model, opt),
                                          gockpt.testing.snapshot(model2, opt2),
                                          "gockpt.load of what dcp.save wrote")
    assert why is None, why
    extra = restored.extra_state  # the rest of the state, under DCP's names
    assert extra["train_state.step"] == 3 and torch.equal(extra["train_state.tokens"],
                                                          torch.tensor(4096 * 3))
    assert extra["lr_scheduler.last_epoch"] == 3


def test_async_save_and_a_checkpoint_id_name_the_step_and_retention_applies(tmp_path):
    run = tmp_path / "run"
    _, _, state = _trained()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.async_save(state, checkpoint_id=str(run / "step-100"),
                       storage_writer=GockptWriter(keep_last=1), no_dist=True).result()
        dcp.save(state, checkpoint_id=str(run / "step-200"),
                 storage_writer=GockptWriter(keep_last=1), no_dist=True)
    assert storage.list_checkpoints(str(run)) == ["step-200"]  # step-100 deleted after it
    assert storage.resolve(str(run)).endswith("step-200")
    assert storage.read_manifest(storage.resolve(str(run)))["step"] == 200
    _, _, fresh = _trained(seed=1, steps=1)
    _dcp_load(storage.resolve(str(run)), fresh)
    assert gockpt.testing.first_difference(state, fresh, "async") is None


def _same_after_gockpt_load(run, model, opt, fresh_model, fresh_opt):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "gockpt: .* keeps no RNG states")
        restored = gockpt.load(run, fresh_model, fresh_opt)
    why = gockpt.testing.first_difference(gockpt.testing.snapshot(model, opt),
                                          gockpt.testing.snapshot(fresh_model, fresh_opt), run)
    assert why is None, why
    return restored


@pytest.mark.parametrize("layout", ["flat-model", "sgd", "same-settings"])
def test_other_layouts_of_the_state_dict_load_bitwise(tmp_path, layout):
    """torchtitan's layout (the model's names at the top, a 0-dim BatchNorm buffer among
    them, the optimizer flattened); SGD without state (only its groups name the parameters);
    two param groups with the same settings, flattened (DCP keeps settings per parameter)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    def objects(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        if layout == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            p = list(model.parameters())
            opt = torch.optim.AdamW([{"params": p[:2]}, {"params": p[2:]}], lr=1e-2)
        for _ in range(2 if seed == 0 else 1):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt
    model, opt = objects(0)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        flatten_optimizer_state_dict=layout != "sgd"))
    state = {**msd, "optimizer": osd} if layout == "flat-model" else \
        {"model": msd, "optimizer": osd}
    _save(state, str(tmp_path / "run"), 1)
    _same_after_gockpt_load(str(tmp_path / "run"), model, opt, *objects(1))


def test_a_tensor_of_the_train_state_comes_back_in_extra_state(tmp_path):
    model, opt, state = _trained()
    rng = torch.get_rng_state()
    state["train_state"]["rng"] = rng  # (one or more dimensions: stored as a tensor of its own)
    _save(state, str(tmp_path / "run"), 3)
    restored = _same_after_gockpt_load(str(tmp_path / "run"), model, opt, *_trained(2, 1)[:2])
    assert torch.equal(restored.extra_state["train_state.rng"], rng)


def test_a_checkpoint_is_never_overwritten_and_a_failed_saves_leftovers_go(tmp_path):
    run = str(tmp_path / "run")
    _, _, state = _trained()
    os.makedirs(os.path.join(run, ".tmp-step-000000003-123-abcd"))  # a failed save's
    _save(state, run, 3)
    assert sorted(os.listdir(run)) == ["latest", "step-000000003"]
    with pytest.raises(CheckpointException, match="exists in .* already"):
        _save(state, run, 3)
    assert gockpt.verify(run).ok
    planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
    with pytest.raises(CheckpointException, match="plan caching"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            for step in (4, 5):  # (the second save is handed the first one's plan)
                dcp.save(state, storage_writer=GockptWriter(run, step=step), planner=planner,
                         no_dist=True)


def test_a_step_committed_beyond_latest_is_saved_again_by_the_resumed_run(tmp_path):
    """Killed between step 5's commit and ``latest``'s update, a run resumes from step 3
    (``latest``) and saves step 5 again: the old step 5 is replaced by the new one, which
    ``latest`` then names; the checkpoint ``latest`` names, an older one and an entry that
    is not a checkpoint are still refused."""
    run = str(tmp_path / "run")
    _, _, state = _trained(seed=1)
    _save(state, run, 3)
    _save(state, run, 5)
    old_seal = read_latest(run)[1]
    write_latest(run, "step-000000003", None)  # (as if killed before the update)
    model, opt, state = _trained(seed=2)
    _save(state, run, 5)
    name, seal = read_latest(run)
    assert name == "step-000000005" and seal != old_seal
    assert gockpt.verify(run).ok
    _same_after_gockpt_load(run, model, opt, *_trained(seed=3, steps=1)[:2])
    for step in (5, 3):  # (latest's own, and one before it: never replaced)
        with pytest.raises(CheckpointException, match="'latest' names 'step-000000005'"):
            _save(state, run, step)
    os.makedirs(os.path.join(run, "step-000000007"))  # (not a checkpoint: no manifest)
    with pytest.raises(CheckpointException, match="exists and is not a committed checkpoint"):
        _save(state, run, 7)
    assert os.listdir(os.path.join(run, "step-000000007")) == []


def test_what_gockpt_cannot_store_without_pickle_is_refused_and_nothing_is_committed(tmp_path):
    run = str(tmp_path / "run")
    _, _, state = _trained()
    state["dataloader"] = {"sampler": object()}  # an arbitrary object: only a pickle holds it
    with pytest.raises(CheckpointException, match=r"cannot store the state without pickle.*"
                                                   r"extra_state\['dataloader.sampler'\]"):
        _save(state, run, 5)
    assert storage.list_checkpoints(run) == []
    with pytest.raises(gockpt.ConfigError, match="must end in its step number"):
        GockptWriter().reset(str(tmp_path / "run" / "final"))
    with pytest.raises(CheckpointException, match="no checkpoint to write"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save({"x": torch.zeros(2)}, storage_writer=GockptWriter(run), no_dist=True)


@pytest.mark.parametrize("optim,kind,loads", [
    ("adamw", "fsdp2", ((4, "dcp"), (1, "dcp"), (1, "dcpgload"), (4, "dcpgload"))),
    ("adamw", "ddp", ((2, "dcpgload"),)), ("nadam", "tiny", ((2, "dcpgload"),))])
def test_dcp_save_on_two_ranks_verifies_and_loads_on_another_number_bitwise(tmp_path, optim,
                                                                            kind, loads):
    """dcp.save of a model trained on 2 ranks (FSDP2: each rank's shards; DDP: DCP writes each
    replicated tensor once, its moments with it) through GockptWriter: gockpt verify passes,
    and dcp.load through GockptReader and gockpt.load bring the state the saving run gathered
    back, bit for bit, on other numbers of ranks (ranks_worker's dcp and dcpgload). NAdam on
    tiny replicated layers: DCP writes a parameter's two scalar states on different ranks;
    rank 0 puts them back together (was: one rank's replaced the other's)."""
    directory = str(tmp_path / kind)
    run_ranks(directory, f"dcpsave:{optim}:{kind}", world=2, worker="ranks_worker")
    path = storage.resolve(directory)
    assert sorted(os.listdir(path)) == ["data.safetensors", "manifest.json", "rank-00000",
                                        "rank-00001"]
    assert gockpt.verify(directory).ok
    for world, scenario in loads:
        run_ranks(directory, f"{scenario}:{optim}:{kind}", world=world, worker="ranks_worker")
