"""gockpt.storage.manifest: the typed manifest, its validation of untrusted input, and the
parts of a checkpoint written by several ranks."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from gockpt.core.errors import CorruptCheckpointError, LoadError
from gockpt.storage import CheckpointWriter, manifest as M, schema as S


# What the storage layer's tensor table says of the stored tensors the sample refers to.
ENTRIES = {name: {"shape": shape, "dtype": "F32"} for name, shape in (
    ("model/a.weight", [2, 3]), ("model/a.bias", [2]), ("optim/0/exp_avg", [2, 3]),
    ("optim/0/exp_avg_sq", [2, 3]), ("pack/model/F32", [20]))}


def ref(name, *a, **k):
    return M.TensorRef(name, *a, **k)


def sample_manifest(**kw):
    fields = dict(
        step=7, start_step=5, mode="gockpt-o", overlap_steps=3, rank=0, world_size=1,
        model=S.ModelSection({"a.weight": ref("model/a.weight"), "a.bias": ref("model/a.bias"),
                              "c.weight": ref("pack/model/F32", 4, (2, 3), (1, 0))},
                             {"b.weight": "a.weight"}),
        small=S.SmallSection(model={"x": 1}, optimizer={"state": {}, "param_groups": []},
                             scheduler=None, rng={"__t": "tensor", "k": "small/rng/0"},
                             extra_state=[1, "two"]),
        optimizer=S.OptimizerSection("AdamW", {0: {"exp_avg": ref("optim/0/exp_avg"),
                                                   "exp_avg_sq": ref("optim/0/exp_avg_sq")},
                                               1: {}}, params={0: "a.weight"}),
        metrics={"blocked_s": 0.5}, tensors=ENTRIES)
    fields.update(kw)
    return S.Manifest(**fields)


def as_read(m):
    """``m`` as read back: its JSON plus the tensor table the storage writer adds."""
    return dict(copy.deepcopy(m.to_json()), tensors=copy.deepcopy(m.tensors))


def test_to_json_from_json_round_trip():
    m = sample_manifest()
    data = m.to_json()
    assert data["optimizer"]["aligned"] == {  # JSON keys; plain references are names
        "0": {"exp_avg": "optim/0/exp_avg", "exp_avg_sq": "optim/0/exp_avg_sq"}, "1": {}}
    assert data["model"]["params"]["c.weight"] == {"tensor": "pack/model/F32", "offset": 4,
                                                   "shape": [2, 3], "dims": [1, 0]}
    assert data["optimizer"]["params"] == {"0": "a.weight"}  # whose state each index is
    back = M.parse("ck", as_read(m))
    assert back == m
    assert back.model.expected()["b.weight"] == ref("model/a.weight")
    assert back.logical_shape(back.model.params["c.weight"]) == (2, 3)


D = "0123456789abcdef" * 2  # a digest as the manifest spells it


def test_digests_round_trip_and_are_checked():
    m = sample_manifest(model=S.ModelSection({"a.weight": ref("model/a.weight")}, {},
                                             {"a.weight": D}),
                        optimizer=S.OptimizerSection("AdamW", {0: {"exp_avg": ref(
                            "optim/0/exp_avg")}}, {0: {"exp_avg": D}}))
    back = M.parse("ck", as_read(m))
    assert back == m
    assert [(what, r.tensor) for what, r, _ in back.digest_checks()] == [
        ("parameter 'a.weight'", "model/a.weight"),
        ("optimizer state [0]['exp_avg']", "optim/0/exp_avg")]
    for section, key, value in [("model", None, {"a.weight": D.upper()}),
                                ("model", None, {"nope": D}),
                                ("model", None, ["a.weight"]),
                                ("optimizer", None, {"0": {"exp_avg_sq": D}}),
                                ("optimizer", None, {"x": {"exp_avg": D}})]:
        data = as_read(m)
        data[section]["digests"] = value
        with pytest.raises(CorruptCheckpointError, match="'digests' are malformed"):
            M.parse("ck", data)
    assert M.parse("ck", as_read(sample_manifest())).model.digests == {}


def test_from_json_reads_the_earlier_format():
    data = as_read(sample_manifest())
    data["model"]["params"] = {"a.weight": "model/a.weight"}
    data["optimizer"]["aligned"] = {"0": ["exp_avg", "exp_avg_sq"]}  # keys: implied names
    back = M.parse("ck", data)
    assert back.model.params == {"a.weight": ref("model/a.weight")}
    assert back.optimizer.aligned == {0: {"exp_avg": ref("optim/0/exp_avg"),
                                          "exp_avg_sq": ref("optim/0/exp_avg_sq")}}


@pytest.mark.parametrize("bad,message", [
    ("model/missing", "refers to tensor 'model/missing', which is not stored"),
    ({"tensor": "pack/model/F32", "offset": 18, "shape": [2, 3]}, "beyond its 20 elements"),
    ({"tensor": "model/a.weight", "dims": [0, 1, 2]}, "do not fit shape"),
    ({"tensor": "model/a.weight", "dims": [1, 1]}, "'model' section"),
    ({"tensor": "model/a.weight", "offset": 3}, "an offset without a shape"),
    ({"tensor": "model/a.weight", "extra": 1}, "'model' section")])
def test_from_json_refuses_a_reference_outside_the_stored_tensors(bad, message):
    data = as_read(sample_manifest())
    data["model"]["params"]["a.weight"] = bad
    with pytest.raises(CorruptCheckpointError, match=message):
        M.parse("ck", data)


def test_a_reference_resolves_to_a_view_with_the_memory_layout():
    pack = torch.arange(20.0)
    t = ref("p", 4, (2, 3), (1, 0)).resolve({"p": pack})
    assert t.shape == (2, 3) and t.stride() == (1, 2)  # stored as its transpose, contiguous
    assert torch.equal(t, pack[4:10].view(3, 2).t())
    whole = ref("w", dims=(0, 2, 3, 1)).resolve({"w": torch.zeros(2, 4, 5, 3)})
    assert whole.shape == (2, 3, 4, 5) and whole.is_contiguous(memory_format=torch.channels_last)


def test_from_json_without_optimizer_and_defaults():
    data = as_read(sample_manifest(optimizer=None))
    del data["rank"], data["world_size"], data["metrics"]
    back = M.parse("ck", data)
    assert back.optimizer is None and back.rank == 0 and back.world_size == 1
    assert back.metrics == {}


def _set(path, value):
    def mutate(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value
    return mutate


_DELETE = object()

MALFORMED = [
    (("step",), _DELETE, "'step'"), (("step",), "7", "'step'"), (("step",), -1, "'step'"),
    (("step",), True, "'step'"), (("start_step",), 1.5, "'start_step'"),
    (("overlap_steps",), None, "'overlap_steps'"), (("mode",), _DELETE, "'mode'"),
    (("mode",), 3, "'mode'"), (("model",), _DELETE, "'model' section"),
    (("model",), [], "'model' section"), (("model", "params"), {"a": 1}, "'model' section"),
    (("model", "aliases"), {"b": None}, "'model' section"),
    (("small",), _DELETE, "'small' section"), (("small", "rng"), _DELETE, "'small' section"),
    (("optimizer",), "AdamW", "'optimizer' section"),
    (("optimizer", "class"), 5, "'optimizer' section"),
    (("optimizer", "aligned"), [], "'optimizer' section"),
    (("optimizer", "aligned"), {"x": ["exp_avg"]}, "'optimizer' section"),
    (("optimizer", "aligned"), {"0": "exp_avg"}, "'optimizer' section"),
    (("optimizer", "aligned"), {"0": [1]}, "'optimizer' section"),
    (("rank",), "0", "'rank'"), (("world_size",), -2, "'world_size'"),
    (("optimizer", "params"), ["a.weight"], "optimizer's 'params' are malformed"),
    (("optimizer", "params"), {"x": "a.weight"}, "optimizer's 'params' are malformed"),
    (("optimizer", "params"), {"0": 3}, "optimizer's 'params' are malformed"),
    (("optimizer", "params"), {"0": "z.weight"}, "'params' name parameters the model section"),
]


@pytest.mark.parametrize("path,value,field", MALFORMED,
                         ids=[f"{'.'.join(p)}={v if v is not _DELETE else 'missing'!r}"
                              for p, v, _ in MALFORMED])
def test_from_json_refuses_each_malformed_field(path, value, field):
    data = as_read(sample_manifest())
    _set(path, value)(data)
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint 'ck/x': manifest: .*{field}"):
        M.parse("ck/x", data)


def test_from_json_refuses_a_non_decimal_digit_index():
    data = as_read(sample_manifest())
    data["optimizer"]["aligned"] = {"²": ["exp_avg"]}
    with pytest.raises(CorruptCheckpointError, match="'optimizer' section"):
        M.parse("ck", data)


# ------------------------------------------------------------------ parts of several ranks

@pytest.mark.parametrize("name", ["../x", "..", ".", ".hidden", "a/b", "a\\b", "", "a\0b", 5, None])
def test_part_names_that_escape_are_refused(name):
    with pytest.raises(CorruptCheckpointError, match="invalid part name"):
        S.check_part_name("ck", name)
    with pytest.raises(CorruptCheckpointError, match="invalid part name"):
        M.parts_of("ck", {"ranks": ["rank-00000", name]})


def test_parts_of():
    assert M.parts_of("ck", {"step": 1}) is None  # one rank
    assert M.parts_of("ck", {"ranks": ["rank-00000", "rank-00001"]}) == \
        ["rank-00000", "rank-00001"]
    for bad in ([], "rank-00000", {"0": "rank-00000"}):
        with pytest.raises(CorruptCheckpointError, match="'ranks'"):
            M.parts_of("ck", {"ranks": bad})


def write_checkpoint(root, name, manifest_json):
    """A committed checkpoint holding "t" and the tensors the sample manifest refers to."""
    w = CheckpointWriter(root, name)
    w.write_tensors({"t": torch.zeros(1), **{n: torch.zeros(e["shape"]) for n, e in ENTRIES.items()}})
    return w.commit(manifest_json, update_latest=False)


def write_two_rank_checkpoint(root, parts=None):
    """What storage.ranks writes: parts inside the top writer's temporary directory."""
    top = CheckpointWriter(root, "step-000000007")
    for r in range(2):
        write_checkpoint(top.tmp_path, S.part_name(r),
                         sample_manifest(rank=r, world_size=2, metrics={"r": r}).to_json())
    manifest = S.PartsManifest(7, 5, "gockpt-o", 3, [S.part_name(r) for r in range(2)]).to_json()
    if parts is not None:
        manifest["ranks"] = parts
    top.write_tensors({})
    return top.commit(manifest)


def test_read_picks_the_part_of_a_rank(tmp_path):
    path = write_two_rank_checkpoint(str(tmp_path))
    where, m = M.read(path, rank=0)
    assert where == os.path.join(path, "rank-00000") and m.rank == 0
    where, m = M.read(path, live_world=2, live_rank=1)
    assert where == os.path.join(path, "rank-00001") and (m.rank, m.world_size) == (1, 2)
    assert m.metrics == {"r": 1}


def test_read_refuses_a_world_size_mismatch_or_a_missing_rank(tmp_path):
    path = write_two_rank_checkpoint(str(tmp_path))
    with pytest.raises(LoadError, match="written by 2 ranks and holds per-rank state; this "
                       "job has 3"):
        M.read(path, live_world=3, live_rank=0)
    with pytest.raises(LoadError, match="this job has 1"):
        M.read(path)  # one process: which rank's state it wants is not guessed
    with pytest.raises(LoadError, match="rank 2 asked"):
        M.read(path, rank=2)


def test_read_refuses_a_part_that_escapes_the_checkpoint(tmp_path):
    path = write_two_rank_checkpoint(str(tmp_path), parts=["../step-000000003", "rank-00001"])
    write_checkpoint(str(tmp_path), "step-000000003", sample_manifest().to_json())
    with pytest.raises(CorruptCheckpointError, match="invalid part name"):
        M.read(path)


def test_read_of_a_single_rank_checkpoint(tmp_path):
    path = write_checkpoint(str(tmp_path), "step-000000007", sample_manifest().to_json())
    where, m = M.read(path)
    assert where == path and m.step == 7 and set(m.tensors) == {"t"} | set(ENTRIES)
