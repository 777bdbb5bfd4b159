"""gockpt.load: a committed checkpoint back into a model, optimizer, scheduler and the RNGs,
exactly; anything that does not fit is refused before the model is touched."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

import gockpt
from gockpt import storage

from tests._support import harness as H


def extra(step):
    return {"step": step, "t": torch.arange(3.0) * step, "pair": (step, "a"),
            "nested": [torch.ones(2, dtype=torch.float16)]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of steps 2 and 5 (async mode) and the live state at each."""
    root = str(tmp_path_factory.mktemp("ckpts"))
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, root, mode="async", scheduler=sched)
    snaps = {}

    def on_boundary(step, handle):
        if handle is not None:
            snaps[step] = H.snapshot(model, opt, sched)

    H.train_steps(model, opt, sched, 0, 6, ck, force={2, 5}, on_boundary=on_boundary,
                  extra=extra)
    ck.close()
    assert sorted(snaps) == [2, 5]
    return root, snaps


def fresh():
    return H.build(seed=123)


def test_a_checkpoints_own_directory_loads_as_the_tools_take_it(saved):
    root, snaps = saved
    model, opt, sched = fresh()
    restored = gockpt.load(os.path.join(root, "step-000000002"), model, opt, scheduler=sched)
    assert restored.step == 2 and restored.path == os.path.join(root, "step-000000002")
    H.assert_same(snaps[2], H.snapshot(model, opt, sched))


def test_a_file_given_as_the_directory_is_named_a_file(saved):
    root, _ = saved
    model, opt, sched = fresh()
    with pytest.raises(gockpt.CheckpointNotFoundError, match="metrics.jsonl' is a file, not a "
                       "directory: give the run directory"):
        gockpt.load(os.path.join(root, "metrics.jsonl"), model, opt, scheduler=sched)


def test_load_restores_everything_exactly(saved):
    root, snaps = saved
    model, opt, sched = fresh()
    H.seed_all(77)  # the RNGs must come back too
    restored = gockpt.load(root, model, opt, scheduler=sched)
    assert restored.step == 5 and restored.path == os.path.join(root, "step-000000005")
    assert restored.manifest.mode == "async" and restored.manifest.step == 5
    H.assert_same(snaps[5], H.snapshot(model, opt, sched))
    H.assert_same(restored.extra_state, extra(5))


def test_tag_selects_a_checkpoint(saved):
    root, snaps = saved
    model, opt, sched = fresh()
    restored = gockpt.load(root, model, opt, scheduler=sched, tag="step-000000002")
    assert restored.step == 2
    H.assert_same(snaps[2], H.snapshot(model, opt, sched))
    with pytest.raises(gockpt.CheckpointNotFoundError, match="step-000000003"):
        gockpt.load(root, model, opt, tag="step-000000003")


def test_restore_rng_false_leaves_the_rngs_alone(saved):
    root, _ = saved
    model, opt, sched = fresh()
    H.seed_all(1234)
    before = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    gockpt.load(root, model, opt, scheduler=sched, restore_rng=False)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.random.get_state()[1].tolist() == before[1][1].tolist()
    assert random.getstate() == before[2]


def test_map_location_moves_the_tensors_of_extra_state(saved):
    root, _ = saved
    model, opt, sched = fresh()
    restored = gockpt.load(root, model, opt, scheduler=sched, map_location="meta")
    ex = restored.extra_state
    assert ex["t"].device.type == "meta" and ex["nested"][0].device.type == "meta"
    assert ex["nested"][0].dtype == torch.float16 and ex["pair"] == (5, "a")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_model_of_another_shape_is_refused_untouched(saved):
    root, _ = saved
    model, opt, sched = fresh()
    model.hidden = torch.nn.Linear(48, 40)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gockpt.LoadError,
                       match=r"'hidden.weight' has shape \[48, 48\] in the checkpoint but "
                             r"\[40, 48\] in the model"):
        gockpt.load(root, model, None)
    H.assert_same(before, dict(model.state_dict()))


def test_a_model_with_another_buffer_is_refused_untouched(saved):
    root, _ = saved
    model, opt, sched = fresh()
    model.register_buffer("extra_buffer", torch.zeros(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gockpt.LoadError, match=r"missing \['extra_buffer'\]"):
        gockpt.load(root, model, opt, scheduler=sched)
    H.assert_same(before, dict(model.state_dict()))


def test_an_optimizer_with_other_groups_is_refused_untouched(saved):
    root, _ = saved
    model, _, _ = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    one_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(gockpt.LoadError, match="1 groups / 12 parameters, the checkpoint 3 / 11"):
        gockpt.load(root, model, one_group)
    H.assert_same(before, dict(model.state_dict()))
    assert one_group.state_dict()["state"] == {}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def flip_a_byte(root, dest, tensor):
    shutil.copytree(root, dest)
    path = storage.resolve(str(dest))
    entry = read_json(os.path.join(path, "manifest.json"))["tensors"][tensor]
    data = os.path.join(path, entry["file"])
    with open(data, "r+b") as f:
        f.seek(entry["offset"] + entry["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    return data


def test_a_flipped_byte_names_file_and_tensor(saved, tmp_path):
    root, snaps = saved
    data = flip_a_byte(root, tmp_path / "copy", "model/hidden.weight")
    model, opt, sched = fresh()
    with pytest.raises(gockpt.CorruptCheckpointError,
                       match=f"{data}.*'model/hidden.weight'.*checksum mismatch"):
        gockpt.load(str(tmp_path / "copy"), model, opt, scheduler=sched)
    # verify=False reads it anyway: one element differs
    gockpt.load(str(tmp_path / "copy"), model, opt, scheduler=sched, verify=False)
    diff = (model.hidden.weight != snaps[5]["model"]["hidden.weight"]).sum().item()
    assert diff == 1


def test_a_chunk_size_beyond_the_reader_is_refused_not_skipped(saved, tmp_path):
    # block_bytes 2**64 - 4096 (a multiple of 4096, one checksum for the tensor: the manifest
    # checks pass) wrapped the C++ reader's chunk count to 0: the parameter was neither read
    # nor checksummed and the fresh model's values stayed (with verify=False, silently).
    from tests._support.manifests import rewrite

    root, snaps = saved
    shutil.copytree(root, tmp_path / "copy")
    path = storage.resolve(str(tmp_path / "copy"))
    entry = read_json(os.path.join(path, "manifest.json"))["tensors"]["model/hidden.weight"]
    assert entry["nbytes"] > 4096 and len(entry["crc32c"]) == 1

    def huge(m):
        m["tensors"]["model/hidden.weight"]["block_bytes"] = 2**64 - 4096

    rewrite(path, huge)
    model, opt, sched = fresh()
    with pytest.raises(gockpt.CorruptCheckpointError, match=r"'model/hidden.weight'.*block_bytes"):
        gockpt.load(str(tmp_path / "copy"), model, opt, scheduler=sched)
    model, opt, sched = fresh()
    gockpt.load(str(tmp_path / "copy"), model, opt, scheduler=sched, verify=False)
    H.assert_same(snaps[5], H.snapshot(model, opt, sched))


def test_a_corrupt_small_tensor_is_found_before_the_model_is_touched(saved, tmp_path):
    root, _ = saved
    tensors = read_json(os.path.join(root, "step-000000005", "manifest.json"))["tensors"]
    small = next(n for n in tensors if n.startswith("small/rng/"))
    flip_a_byte(root, tmp_path / "copy", small)
    model, opt, sched = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gockpt.CorruptCheckpointError, match=small):
        gockpt.load(str(tmp_path / "copy"), model, opt, scheduler=sched)
    H.assert_same(before, dict(model.state_dict()))


def many_small(seed=0):
    """40 small parameters: stored as one pack per role."""
    torch.manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(5)) for _ in range(40)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), None


@pytest.mark.parametrize("build,stored", [(H.build, "model/hidden.weight"),
                                          (H.build, "optim/0/exp_avg_sq"),
                                          (many_small, "pack/model/F32"),
                                          (many_small, "pack/optim/exp_avg/F32")])
def test_intact_bytes_that_are_not_the_training_state_are_refused(tmp_path, build, stored):
    # A storage plugin writes zeros for one stored tensor: its checksums match (computed on
    # what was written), only the digests of the live tensors at F, recorded in the manifest,
    # tell. Packed small tensors are checked too (each by its own range).
    from tests._support.faulty_storage import misplacing_writer
    H.seed_all(0)
    model, opt, sched = build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched,
                             storage_writer=misplacing_writer(stored))
    for step in range(3):
        ck.backward_begin()
        sum(p.square().sum() for p in model.parameters()).backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1, force=step == 2)
    ck.close()
    manifest = read_json(tmp_path / storage.checkpoint_name(3) / "manifest.json")
    assert stored in manifest["tensors"], sorted(manifest["tensors"])
    m, o, s = build(seed=123)
    with pytest.raises(gockpt.CorruptCheckpointError,
                       match="do not hold the training state the checkpoint was taken from"):
        gockpt.load(str(tmp_path), m, o, scheduler=s)
    report = gockpt.verify(str(tmp_path))
    assert not report.ok
    [bad] = report.checkpoints[0].bad
    assert bad.tensor == stored and "differ from the live state at step 3" in bad.error
    gockpt.load(str(tmp_path), m, o, scheduler=s, verify=False)  # asked not to check


def test_every_stored_parameter_and_state_has_its_digest(saved):
    root, _ = saved
    manifest = read_json(os.path.join(root, storage.checkpoint_name(5), "manifest.json"))
    assert set(manifest["model"]["digests"]) == set(manifest["model"]["params"])
    assert {i: set(d) for i, d in manifest["optimizer"]["digests"].items()} == \
        {i: set(r) for i, r in manifest["optimizer"]["aligned"].items()}
    m = gockpt.metrics.read(root)[-1]
    assert m["verify_tensors"] == len(manifest["model"]["params"]) + \
        sum(len(r) for r in manifest["optimizer"]["aligned"].values())
    assert m["verify_mismatches"] == 0 and m["verify_s"] > 0


# ------------------------------------------------------------------ one string, one directory


def test_one_path_names_one_directory_everywhere(tmp_path, monkeypatch, capsys):
    # The kernel's rule (gockpt.core.paths) for the Checkpointer, gockpt.load, gockpt.verify and the
    # tool: `link/..` is the parent of the link's target, not the directory holding the link.
    # Before, the Checkpointer normalised the text (link/../run -> ./run) while gockpt.load
    # asked the kernel (real/run): a checkpoint written there was "not found" under the string
    # that wrote it.
    from gockpt.cli import main as gockpt_cli

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    where = "./link/../run"
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, where, mode="sync", scheduler=sched)
    assert ck.config.directory == str(tmp_path / "real" / "run")
    snaps = {}
    H.train_steps(model, opt, sched, 0, 3, ck, force={2},
                  on_boundary=lambda s, h: snaps.setdefault(s, H.snapshot(model, opt, sched))
                  if h is not None else None)
    ck.close()
    assert storage.list_checkpoints(str(tmp_path / "real" / "run")) == ["step-000000002"]
    assert not (tmp_path / "run").exists()

    model2, opt2, sched2 = fresh()
    restored = gockpt.load(where, model2, opt2, scheduler=sched2)
    assert restored.path == str(tmp_path / "real" / "run" / "step-000000002")
    H.assert_same(snaps[2], H.snapshot(model2, opt2, sched2))
    assert gockpt.verify(where).ok
    for cmd in (["list", where], ["inspect", where], ["verify", where]):
        assert gockpt_cli(cmd) == 0, capsys.readouterr().err
        assert "step-000000002" in capsys.readouterr().out
    # An output path by the same rule: no `x`, no `x/..`.
    assert gockpt_cli(["export", where, "--to", "torch", "./x/../o.pt"]) == 2
    assert "'x' does not exist" in capsys.readouterr().err and not (tmp_path / "o.pt").exists()
    assert gockpt_cli(["export", where, "--to", "torch", "./link/../o.pt"]) == 0
    assert (tmp_path / "real" / "o.pt").exists()


def test_a_dotdot_after_a_missing_name_is_refused_everywhere(tmp_path, monkeypatch, capsys):
    # `./x/../ckpt/run` with no `x`: the kernel finds nothing; the Checkpointer used to write
    # into ./ckpt/run (the text normalised) while gockpt.load said it did not exist.
    from gockpt.cli import main as gockpt_cli

    monkeypatch.chdir(tmp_path)
    where = "./x/../ckpt/run"
    model, opt, _ = H.build()
    with pytest.raises(gockpt.ConfigError, match=r"'x' does not exist"):
        gockpt.Checkpointer(model, opt, where, mode="sync")
    assert os.listdir(tmp_path) == []  # neither ckpt/run nor x created
    with pytest.raises(gockpt.CheckpointNotFoundError, match=r"'x' does not exist"):
        gockpt.load(where, model, opt)
    with pytest.raises(gockpt.CheckpointNotFoundError, match=r"'x' does not exist"):
        gockpt.verify(where)
    for cmd in (["list", where], ["inspect", where], ["verify", where], ["clean", where],
                ["export", where, "--to", "torch", "o.pt"]):
        assert gockpt_cli(cmd) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'x' does not exist" in err, (cmd, err)
