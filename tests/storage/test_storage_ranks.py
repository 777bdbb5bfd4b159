"""Several ranks (processes with gloo, as torchrun starts them) commit one checkpoint
together; a checkpoint missing a rank is never visible."""

import json
import os

from gockpt import storage

from tests._support.dist_ranks import run_ranks


def test_two_ranks_commit_together_and_load_their_own_part(tmp_path):
    run_ranks(tmp_path, "ok")
    path = storage.resolve(str(tmp_path))
    top = json.load(open(os.path.join(path, "manifest.json")))
    assert top["world_size"] == 2 and top["ranks"] == ["rank-00000", "rank-00001"]
    for part in top["ranks"]:
        storage.read_tensors(os.path.join(path, part),
                             storage.read_manifest(os.path.join(path, part)))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_a_checkpoint_missing_a_rank_is_never_latest(tmp_path):
    outs = run_ranks(tmp_path, "one-rank-fails")
    assert "failed as expected" in outs[0][0] and "failed as expected" in outs[1][0]


def test_whether_a_name_is_free_is_rank_0s_answer_on_every_rank(tmp_path):
    outs = run_ranks(tmp_path, "named")
    assert all("ok (named)" in out for out, _ in outs)
