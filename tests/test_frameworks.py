"""The frameworks users wrap their models in: what gockpt supports works, what it does not
support yet is refused at construction with a clear error -- never a silently wrong checkpoint.
Multi-rank cases run real gloo ranks (tests/_support/frameworks_worker.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gockpt
import gockpt.storage.manifest
import gockpt.testing
from tests._support.dist_ranks import run_ranks

WORKER = "frameworks_worker"  # a module of tests._support


@pytest.mark.parametrize("mode", gockpt.MODES)
def test_tensors_without_addressable_memory_are_refused(tmp_path, mode):
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(gockpt.UnsupportedTensorError, match="'weight' has no data yet"):
        gockpt.Checkpointer(meta, torch.optim.AdamW(meta.parameters()), str(tmp_path), mode=mode)
    lazy = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(gockpt.UnsupportedTensorError, match="a lazy module"):
        gockpt.Checkpointer(lazy, torch.optim.AdamW(lazy.parameters()), str(tmp_path), mode=mode)
    gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=2).close()  # free


# ------------------------------------------------------------------ wrappers change no name

def _tiny(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _assert_loaded(expected, model, opt):
    got = gockpt.testing.snapshot(model, opt)
    for key in ("model", "optimizer"):
        why = gockpt.testing.first_difference(expected[key], got[key], key)
        assert why is None, why


@pytest.mark.slow
def test_a_ddp_checkpoint_loads_unwrapped_on_one_rank(tmp_path):
    directory = str(tmp_path / "ddp")
    run_ranks(directory, "ddp-save", world=2, worker=WORKER)
    manifest = gockpt.storage.manifest.read(gockpt.storage.resolve(directory), rank=0)[1]
    assert manifest.replicated and "0.weight" in manifest.model.params
    model, opt = _tiny(seed=7)
    gockpt.load(directory, model, opt, restore_rng=False)  # 2 ranks wrote it; replicated
    _assert_loaded(torch.load(directory + ".expected.pt", weights_only=True), model, opt)


@pytest.mark.slow
def test_an_unwrapped_checkpoint_loads_into_ddp_on_two_ranks(tmp_path):
    from tests._support.frameworks_worker import train_and_save
    directory = str(tmp_path / "plain")
    model, opt = _tiny()
    ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=2,
                             block_bytes=256)
    torch.save(train_and_save(model, opt, ck, 0, 6, 3), directory + ".expected.pt")
    run_ranks(directory, "load-into-ddp", world=2, worker=WORKER)


@pytest.mark.parametrize("compiled_at", ["save", "load"])
def test_a_compiled_model_and_its_original_share_checkpoints(tmp_path, compiled_at):
    from tests._support.frameworks_worker import train_and_save
    model, opt = _tiny()
    wrapped = torch.compile(model, backend="eager")  # the OptimizedModule (_orig_mod.) names
    assert next(iter(wrapped.state_dict())).startswith("_orig_mod.")
    ck = gockpt.Checkpointer(wrapped if compiled_at == "save" else model, opt, str(tmp_path),
                             mode="gockpt-o", overlap_steps=2, block_bytes=256)
    expected = train_and_save(wrapped, opt, ck, 0, 6, 3)
    fresh, fresh_opt = _tiny(seed=7)
    target = torch.compile(fresh, backend="eager") if compiled_at == "load" else fresh
    gockpt.load(str(tmp_path), target, fresh_opt, restore_rng=False)
    _assert_loaded(expected, fresh, fresh_opt)


@pytest.mark.slow
def test_per_rank_state_is_refused_on_another_world_size(tmp_path):
    directory = str(tmp_path / "per-rank")
    run_ranks(directory, "per-rank-save", world=2, worker=WORKER)
    model, opt = _tiny(seed=7)
    with pytest.raises(gockpt.LoadError, match="written by 2 ranks and holds per-rank state; "
                       "this job has 1"):
        gockpt.load(directory, model, opt, restore_rng=False)
    gockpt.load(directory, model, opt, restore_rng=False, rank=1)  # asked for on purpose
    _assert_loaded(torch.load(directory + ".expected-1.pt", weights_only=True), model, opt)
