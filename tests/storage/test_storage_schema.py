"""gockpt.storage.schema: the manifest as typed data, and every name a stored tensor or a
rank's part has (parsing and validation of untrusted JSON: test_storage_manifest.py)."""

from __future__ import annotations

import os

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.core.errors import CorruptCheckpointError
from gockpt.storage import manifest as M, schema as S
from gockpt.storage.refs import TensorRef

from tests._support import harness as H


def test_stored_tensor_names():
    assert S.param_tensor("inp.weight") == "model/inp.weight"
    assert S.optim_tensor(3, "exp_avg") == "optim/3/exp_avg"
    assert S.small_prefix("rng") == "small/rng"
    assert S.is_small_tensor(S.small_prefix("optimizer") + "/0")
    assert not S.is_small_tensor(S.param_tensor("small.weight"))
    assert S.pack_name(None, "F32") == "pack/model/F32"
    assert S.pack_name("exp_avg", "BF16") == "pack/optim/exp_avg/BF16"
    for role in (None, "exp_avg"):
        assert S.pack_name(role, "F16").startswith(S.pack_prefix(role))
    assert not S.pack_name("exp_avg_sq", "F32").startswith(S.pack_prefix("exp_avg"))


def test_part_names():
    assert S.part_name(3) == "rank-00003" and S.part_name(12345) == "rank-12345"
    assert sorted(S.part_name(r) for r in (10, 2, 1)) == [S.part_name(r) for r in (1, 2, 10)]
    for good in ("rank-00000", "a b", "x" * 255):
        assert S.check_part_name("ck", good) == good


@pytest.mark.parametrize("name", ["x" * 256, "ränk", "a\tb", "a\nb"])
def test_part_names_too_long_or_not_plain_ascii_are_refused(name):
    with pytest.raises(CorruptCheckpointError, match="checkpoint 'ck': invalid part name"):
        S.check_part_name("ck", name)


def test_the_names_of_a_real_checkpoint_follow_the_rules(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    with gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched,
                             block_bytes=512) as ck:
        H.train_steps(model, opt, sched, 0, 2, ck, force={2})
    path = os.path.join(str(tmp_path), storage.checkpoint_name(2))
    m = M.parse(path, storage.read_manifest(path))
    for name, r in m.model.params.items():
        assert r.tensor == S.param_tensor(name) or r.tensor.startswith(S.pack_prefix(None))
    for idx, refs in m.optimizer.aligned.items():
        for key, r in refs.items():
            assert r.tensor == S.optim_tensor(idx, key) or r.tensor.startswith(S.pack_prefix(key))
    assert {n.split("/")[0] for n in m.tensors} <= {"model", "optim", "pack", "small"}
    assert any(S.is_small_tensor(n) for n in m.tensors)  # RNG states, step counters
    assert m.to_json()["step"] == 2 and "replicated" not in m.to_json()


def test_model_section_expected_answers_to_aliases():
    a = TensorRef("model/a.weight")
    section = S.ModelSection({"a.weight": a}, {"b.weight": "a.weight", "c.weight": "gone"})
    assert section.expected() == {"a.weight": a, "b.weight": a}  # an alias of nothing: left out
    assert section.params == {"a.weight": a}  # not changed


def test_small_section_encode_decode_round_trip():
    rng = torch.random.get_rng_state()
    values = {"model": {"bn.running_mean": torch.arange(3.0)}, "optimizer": None,
              "scheduler": {"last_epoch": 4, "lr": [0.1, 0.2]}, "rng": {"torch": rng},
              "extra_state": {"epoch": 1, "note": "x"}}
    small, tensors = S.SmallSection.encode(values)
    assert tensors and all(S.is_small_tensor(n) for n in tensors)
    assert all(n.startswith(S.small_prefix("rng")) for n in small.tensor_refs("rng"))
    assert set(small.tensor_refs("model")) <= set(tensors)
    values["model"]["bn.running_mean"].add_(1)  # encoded: copied out, not referred to
    assert small.decode("model", tensors)["bn.running_mean"].tolist() == [0.0, 1.0, 2.0]
    assert torch.equal(small.decode("rng", tensors)["torch"], rng)
    assert small.decode("scheduler", tensors) == {"last_epoch": 4, "lr": [0.1, 0.2]}
    assert small.decode("extra_state", tensors) == {"epoch": 1, "note": "x"}
    assert small.decode("optimizer", tensors) is None
    small.rng = S.ABSENT
    with pytest.raises(ValueError, match="no small/rng section"):
        small.decode("rng", tensors)


def manifest(**kw):
    fields = dict(step=9, start_step=8, mode="gockpt", overlap_steps=2,
                  model=S.ModelSection({"w": TensorRef("model/w"), "v": TensorRef("model/v")},
                                       digests={"w": "a" * 32, "gone": "b" * 32}),
                  small=S.SmallSection(),
                  optimizer=S.OptimizerSection("AdamW", {0: {"exp_avg": TensorRef("optim/0/exp_avg")}},
                                               {0: {"exp_avg": "c" * 32, "exp_avg_sq": "d" * 32}}))
    fields.update(kw)
    return S.Manifest(**fields)


def test_manifest_to_json():
    data = manifest().to_json()
    assert {k: data[k] for k in ("step", "start_step", "mode", "overlap_steps", "rank",
                                 "world_size")} == \
        {"step": 9, "start_step": 8, "mode": "gockpt", "overlap_steps": 2, "rank": 0,
         "world_size": 1}
    assert data["optimizer"] == {"class": "AdamW", "aligned": {"0": {"exp_avg": "optim/0/exp_avg"}},
                                 "digests": {"0": {"exp_avg": "c" * 32, "exp_avg_sq": "d" * 32}}}
    assert set(data["small"]) == set(S.SMALL_SECTIONS) and "replicated" not in data
    assert manifest(replicated=True).to_json()["replicated"] is True
    assert "optimizer" not in manifest(optimizer=None).to_json()


def test_digest_checks_skip_digests_of_what_is_not_stored():
    checks = manifest().digest_checks()
    assert checks == [("parameter 'w'", TensorRef("model/w"), "a" * 32),
                      ("optimizer state [0]['exp_avg']", TensorRef("optim/0/exp_avg"), "c" * 32)]
    assert len(manifest(optimizer=None).digest_checks()) == 1


def test_parts_manifest_to_json():
    parts = [S.part_name(r) for r in range(3)]
    data = S.PartsManifest(7, 5, "gockpt-o", 3, parts).to_json()
    assert data == {"step": 7, "start_step": 5, "mode": "gockpt-o", "overlap_steps": 3,
                    "world_size": 3, "ranks": parts}
    assert S.PartsManifest(7, 5, "gockpt-o", 3, parts, replicated=True).to_json()["replicated"]
    assert M.parts_of("ck", data) == parts  # what the reader finds the parts by
