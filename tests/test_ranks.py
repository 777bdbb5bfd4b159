"""Several ranks (processes with gloo, as torchrun starts them) commit one checkpoint
together; a checkpoint missing a rank is never visible."""

import json
import os
import socket
import subprocess
import sys

import pytest

from gockpt import storage

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory, scenario, world=2):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join(sys.path))
        procs.append(subprocess.Popen([sys.executable, WORKER, str(directory), scenario],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out}\n{err}"
        assert f"rank {rank}: ok" in out
    return outs


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
