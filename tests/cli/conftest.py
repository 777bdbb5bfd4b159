"""Checkpoints the tests of the `gockpt` console tool share (built once per session; tests that
damage one work on a copy)."""

import shutil

import pytest
import torch

from gockpt import storage
from tests._support.cli_helpers import make_model, train


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A run directory with checkpoints of steps 4 and 7 (latest). Do not modify: copy it."""
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("run")
    model, opt = make_model()
    train(d, model, opt)
    assert storage.list_checkpoints(str(d)) == ["step-000000004", "step-000000007"]
    return str(d)


@pytest.fixture
def run_copy(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return str(dst)


@pytest.fixture(scope="session")
def ranks_dir(tmp_path_factory):
    """A run directory holding one checkpoint (step 4) written by two real ranks (gloo
    subprocesses, as tests/storage/test_storage_ranks.py starts them). Do not modify: copy it."""
    from tests._support.dist_ranks import run_ranks
    d = tmp_path_factory.mktemp("ranks")
    run_ranks(d, "ok")
    assert storage.list_checkpoints(str(d)) == ["step-000000004"]
    return str(d)


@pytest.fixture
def ranks_copy(ranks_dir, tmp_path):
    dst = tmp_path / "ranks"
    shutil.copytree(ranks_dir, dst)
    return str(dst)
