"""gockpt.verify: a library call that checks committed checkpoints without loading them."""

import os
import shutil

import pytest

import gockpt
from gockpt import storage
from gockpt.storage.verify import BadTensor, MissingPart
from tests._support.manifests import rewrite, write_sealed


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two committed checkpoints of the harness model (sync mode: fast). Do not modify: copy it."""
    from tests._support import harness
    model, opt, sched = harness.build(seed=0)
    d = str(tmp_path_factory.mktemp("run"))
    ck = gockpt.Checkpointer(model, opt, d, scheduler=sched, mode="sync", interval=2)
    harness.train_steps(model, opt, sched, 0, 4, ck)
    ck.close()
    assert len(storage.list_checkpoints(d)) == 2
    return d


@pytest.fixture
def ckpt(run_dir, tmp_path):
    """A copy of the latest checkpoint of ``run_dir``."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(storage.resolve(run_dir), dst)
    return dst


def test_a_good_checkpoint_verifies(run_dir):
    latest = storage.resolve(run_dir)
    report = gockpt.verify(run_dir)  # a run directory: its latest checkpoint
    manifest = storage.read_manifest(latest)
    assert report.ok
    [r] = report.checkpoints
    assert r.ok and r.path == os.path.abspath(latest) and r.step == manifest["step"]
    assert r.tensors == len(manifest["tensors"]) and r.bad == [] and r.problems == []
    assert r.parts is None and r.bytes == sum(e["nbytes"] for e in manifest["tensors"].values())
    assert gockpt.verify(latest).checkpoints[0].to_json() == r.to_json()
    everything = gockpt.verify(run_dir, all=True)
    assert everything.ok
    assert [os.path.basename(c.path) for c in everything.checkpoints] == \
        storage.list_checkpoints(run_dir)


def test_a_flipped_byte_names_the_tensor_and_file(ckpt):
    manifest = storage.read_manifest(ckpt)
    name = next(n for n in manifest["tensors"] if n.startswith("model/"))
    e = manifest["tensors"][name]
    with open(os.path.join(ckpt, e["file"]), "r+b") as f:
        f.seek(e["offset"] + e["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    report = gockpt.verify(ckpt)
    assert not report.ok
    [r] = report.checkpoints
    assert [(b.tensor, b.file, b.rank) for b in r.bad] == [(name, e["file"], None)]
    assert isinstance(r.bad[0], BadTensor) and "checksum mismatch" in r.bad[0].error
    assert r.tensors == len(manifest["tensors"]) - 1 and r.problems == []


def test_a_missing_file_is_reported(ckpt):
    os.unlink(os.path.join(ckpt, storage.DATA_FILE))
    [r] = gockpt.verify(ckpt).checkpoints
    assert not r.ok and r.step is None and r.tensors == 0
    assert len(r.problems) == 1 and "data file missing" in r.problems[0]


def test_a_missing_part_is_reported(ckpt, tmp_path):
    # A checkpoint of two ranks whose rank 1 part is gone: rank 0's part is a real checkpoint.
    multi = tmp_path / "multi"
    multi.mkdir()
    part0 = multi / "rank-00000"
    shutil.copytree(ckpt, part0)
    m = rewrite(part0, lambda m: m.update(rank=0, world_size=2))
    top = {"format": storage.FORMAT, "format_version": storage.FORMAT_VERSION, "tensors": {},
           "step": m["step"], "start_step": m["start_step"], "mode": m["mode"],
           "overlap_steps": m["overlap_steps"], "world_size": 2,
           "ranks": ["rank-00000", "rank-00001"]}
    write_sealed(multi / storage.MANIFEST_FILE, top)

    [r] = gockpt.verify(str(multi)).checkpoints
    assert not r.ok and r.world_size == 2 and r.bad == [] and r.problems == []
    assert r.missing == [MissingPart(1, "rank-00001", "directory rank-00001/ does not exist")]
    assert [(p.name, p.ok, p.error) for p in r.parts] == [
        ("rank-00000", True, None), ("rank-00001", False, "directory rank-00001/ does not exist")]
    assert r.tensors == len(m["tensors"])
    assert r.to_json()["missing"] == [{"rank": 1, "part": "rank-00001",
                                       "error": "directory rank-00001/ does not exist"}]
