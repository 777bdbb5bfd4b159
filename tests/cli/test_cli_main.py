"""Tests of the `gockpt` tool as a whole (gockpt/cli/__init__.py): exit statuses, one-line
errors, --rank on a single-rank checkpoint, the console script and `python -m gockpt.cli`."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gockpt
from gockpt import storage

from tests._support.cli_helpers import flip_byte, run
from tests._support.manifests import write_sealed


@pytest.mark.parametrize("cmd", [["inspect"], ["verify"], ["list"],
                                 ["export", "--to", "torch", "OUT"]])
def test_missing_path_is_exit_2_with_one_line(cmd, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    argv = [cmd[0], missing] + cmd[1:]
    if cmd[0] == "export":
        argv = ["export", missing, "--to", "torch", str(tmp_path / "o.pt")]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gockpt: error:") and missing in err


def test_not_a_checkpoint_is_exit_2(tmp_path, capsys):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "file.txt").write_text("hello")
    rc, _, err = run(capsys, "inspect", str(tmp_path / "stuff"))
    assert rc == 2 and "neither a gockpt checkpoint nor a run directory" in err
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "verify", str(tmp_path / "stuff" / "file.txt"))
    assert rc == 2 and "not a directory" in err


def test_corrupt_manifest_is_exit_1(run_copy, capsys):
    write_sealed(os.path.join(run_copy, "step-000000007"),
                 {"format": storage.FORMAT, "format_version": storage.FORMAT_VERSION,
                  "tensors": 3})
    rc, out, err = run(capsys, "inspect", run_copy)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "'tensors' is missing or not an object" in err
    rc, out, _ = run(capsys, "list", run_copy)  # list still works and flags it
    assert rc == 0
    assert "CORRUPT" in next(li for li in out.splitlines() if "step-000000007" in li)


def test_usage_errors_are_exit_2(capsys):
    assert run(capsys)[0] == 2
    rc, _, err = run(capsys, "export", "somewhere", "out.pt")  # --to missing
    assert rc == 2 and "--to" in err
    rc, _, err = run(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err


def test_rank_option_on_a_single_rank_checkpoint(run_dir, tmp_path, capsys):
    rc, _, err = run(capsys, "inspect", run_dir, "--rank", "0")
    assert rc == 0, err
    rc, _, err = run(capsys, "inspect", run_dir, "--rank", "1")
    assert rc == 2 and "single process" in err
    rc, _, err = run(capsys, "export", run_dir, "--to", "torch", str(tmp_path / "x.pt"),
                     "--rank", "1")
    assert rc == 2 and "single process" in err


def test_installed_console_script(run_copy, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "gockpt")
    if not os.path.exists(exe):
        exe = shutil.which("gockpt")
    assert exe, "the gockpt console script is not installed (pip install -e .)"
    p = subprocess.run([exe, "list", run_copy], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "step-000000007" in p.stdout and "latest" in p.stdout
    flip_byte(os.path.join(run_copy, "step-000000007"), "model/0.weight")
    p = subprocess.run([exe, "verify", run_copy], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "'model/0.weight'" in p.stdout and "verification failed" in p.stderr


def test_python_m_gockpt_cli(run_copy):
    """`python -m gockpt.cli` is the same tool (here: this checkout's gockpt)."""
    root = os.path.dirname(os.path.dirname(gockpt.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + sys.path))
    p = subprocess.run([sys.executable, "-m", "gockpt.cli", "verify", run_copy], cwd=root,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("OK") and "step-000000007" in p.stdout
    p = subprocess.run([sys.executable, "-m", "gockpt.cli", "list", "--json", run_copy],
                       cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [r["name"] for r in json.loads(p.stdout)] == ["step-000000004", "step-000000007"]
    p = subprocess.run([sys.executable, "-m", "gockpt.cli", "frobnicate"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "invalid choice" in p.stderr


def _tool(name):
    """The command line of console tool ``name`` run from this checkout (as its entry point)."""
    module = {"gockpt": "gockpt.cli", "gockpt-interval": "gockpt.cli.interval"}[name]
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())"]


@pytest.mark.parametrize("reader", ["gone before the first write", "gone after one line"])
@pytest.mark.parametrize("tool", ["gockpt", "gockpt-interval"])
def test_tools_stop_quietly_when_their_reader_goes_away(tool, reader, tmp_path):
    # `gockpt ... | head`: once the reader has gone, writing raises EPIPE; the tool used to end
    # with "error: [Errno 32] Broken pipe" (gockpt-interval, status 2) or Python's
    # "Exception ignored ... BrokenPipeError" at exit. Output over the pipe's 64 KiB, so that
    # the second case breaks in the middle of a write.
    if tool == "gockpt":  # a tensor table of 3,000 lines
        w = storage.CheckpointWriter(str(tmp_path), "step-000000001")
        w.write_tensors({f"layer{i}.weight": torch.zeros(3) for i in range(3000)})
        args = ["inspect", w.commit({"step": 1})]
    else:
        args = ["--mtbf", "86400", "--step-time", "2", "--compare",
                *[f"scheme{i}={1 + i / 100}" for i in range(3000)]]
    root = os.path.dirname(os.path.dirname(gockpt.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + sys.path))
    r, w = os.pipe()
    p = subprocess.Popen(_tool(tool) + args, stdout=w, stderr=subprocess.PIPE, cwd=root, env=env)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        if reader == "gone after one line":
            assert f.readline()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and err == b"", err.decode()
