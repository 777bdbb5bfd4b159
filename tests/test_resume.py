"""Acceptance: a run that checkpoints, is killed (SIGKILL) and resumes in a fresh process
produces bitwise the same losses and final parameters as an uninterrupted run."""

import json

import pytest

from gockpt import storage

from tests._support import worker_env
from tests._support.forked import run_worker

pytestmark = pytest.mark.slow

WORKER = "resume_worker"  # a module of tests._support
TOTAL = 30


def run(*args):
    # A fresh process (forked from the session's server that imported torch once: a real
    # SIGKILL, a real restart); it imports the gockpt this test imported, this checkout's.
    return run_worker(WORKER, *args, env=worker_env(), timeout=300)


@pytest.mark.parametrize("mode", ["gockpt-o", "gockpt", "async"])
def test_killed_run_resumes_bit_for_bit(tmp_path, mode):
    ref = run("reference", tmp_path, mode, TOTAL, 0)
    assert ref.returncode == 0, ref.stderr
    reference = json.loads(ref.stdout.splitlines()[-1])

    killed = run("train", tmp_path, mode, TOTAL, 22)
    assert killed.returncode == -9, killed.stderr  # really killed, not a clean exit
    before_kill = json.loads(killed.stdout.splitlines()[-1])["losses"]
    assert before_kill == reference["losses"][:22]
    assert storage.list_checkpoints(str(tmp_path))

    resumed = run("resume", tmp_path, mode, TOTAL, 0)
    assert resumed.returncode == 0, resumed.stderr
    out = json.loads(resumed.stdout.splitlines()[-1])
    assert 5 <= out["start"] < 22
    assert out["losses"] == reference["losses"][out["start"]:]
    assert out["digest"] == reference["digest"]
