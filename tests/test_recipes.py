"""The recipes of the top-level integrations/ (what a user copies; not in the wheel) run as
shipped, in fresh processes (forked from the tests' server), on a tiny model: each trains with
checkpoints, is stopped (killed with os._exit or SIGKILL, or at the end of a shorter run), runs
again with the same command, resumes from the newest committed checkpoint, and ends with the
losses and the state digest of an uninterrupted run, bit for bit.  The scripts write what is
compared (``--record``)."""

import json
import os
import runpy

import pytest

import gockpt
from tests._support.dist_ranks import free_port
from tests._support.forked import Forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "integrations")
CUSTOM = os.path.join(RECIPES, "custom_loop", "train.py")
DEEPSPEED = os.path.join(RECIPES, "deepspeed", "train.py")
DS_CONFIG = os.path.join(RECIPES, "deepspeed", "ds_config.json")
DCP = os.path.join(RECIPES, "dcp", "train.py")
FRAMEWORKS = {"lightning": os.path.join(RECIPES, "lightning", "train.py"),
              "transformers": os.path.join(RECIPES, "transformers", "train.py")}
TINY = ["--dim", "32", "--layers", "1", "--vocab", "64", "--seq-len", "16"]


def env(**more):
    # this checkout's gockpt, whatever the venv has installed
    path = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                     if p])
    return dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore", **more)


def run(script, args, cwd, world=1, expect_rc=0, timeout=300):
    """``script args`` as ``world`` ranks (torchrun's environment, gloo; one rank: plain
    ``python``, the script fills in the rest); returns rank 0's stdout.  Each rank must exit
    with ``expect_rc``. Each rank is a fresh process forked from the tests' server that
    imported torch and DeepSpeed once (tests/_support/forked.py), run as ``python script``
    runs it: seconds of imports less per process."""
    port = str(free_port())  # not the script's default: other tests may run beside these
    procs = [Forked(script, list(args), cwd=cwd,
                    env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port) if world > 1
                    else env(MASTER_PORT=port))
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == expect_rc, f"rank {r} exited {p.returncode}:\n{out}\n{err[-4000:]}"
    return outs[0][0]


def record(path):
    with open(path) as f:
        rec = json.load(f)
    rec["losses"] = {int(k): v for k, v in rec["losses"].items()}
    return rec


def assert_resumed_bitwise(resumed, full, steps):
    """The resumed run trained the steps after its checkpoint exactly like the uninterrupted
    one (every loss, bit for bit as floats) and ends in the same state (digest)."""
    assert sorted(resumed["losses"]) == list(range(resumed["start"] + 1, steps + 1))
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], f"step {step}: {loss!r} vs {full['losses'][step]!r}"
    assert resumed["digest"] == full["digest"]


@pytest.mark.slow
def test_custom_loop_recipe_resumes_bit_for_bit_after_a_crash(tmp_path):
    # K = 3: each checkpoint copied over 3 steps, 2 optimizer steps replayed on the CPU
    args = ["--steps", "24", "--every", "6", "--overlap-steps", "3", "--warmup", "5", *TINY]
    run(CUSTOM, [*args, "--save-dir", "full", "--record", "full.json"], tmp_path)
    out = run(CUSTOM, [*args, "--save-dir", "ckpt", "--crash-at", "20"], tmp_path, expect_rc=3)
    assert "step 20: crashing" in out
    out = run(CUSTOM, [*args, "--save-dir", "ckpt", "--record", "resumed.json"], tmp_path)
    full, resumed = record(tmp_path / "full.json"), record(tmp_path / "resumed.json")
    # the newest committed when the process died: 18 if its write had finished, else 12
    assert resumed["start"] in (12, 18) and f"resumed from {tmp_path / 'ckpt'}" in out
    assert_resumed_bitwise(resumed, full, 24)
    assert full["start"] == 0 and sorted(full["losses"]) == list(range(1, 25))
    metrics = gockpt.metrics.read(str(tmp_path / "full"), rank=0)
    assert [(m["final_step"], m["overlap_steps"], m["grad_steps"]) for m in metrics] == \
        [(6, 3, 2), (12, 3, 2), (18, 3, 2), (24, 3, 2)]
    assert sorted(p.name for p in (tmp_path / "full").glob("step-*")) == \
        ["step-000000012", "step-000000018", "step-000000024"]  # keep_last=3
    assert gockpt.verify(str(tmp_path / "ckpt")).ok


@pytest.fixture(scope="module")
def deepspeed_installed():
    pytest.importorskip("deepspeed")  # installed by the README's setup: never skips in CI


@pytest.mark.slow
def test_deepspeed_recipe_one_rank_resumes_bit_for_bit_after_a_crash(tmp_path,
                                                                      deepspeed_installed):
    """The shipped ds_config.json as it is (bf16, ZeRO 1, AdamW (0.9, 0.95), clipping,
    WarmupCosineLR, "gockpt": gockpt-o, keep_last 3), with plain `python` as one rank."""
    args = ["--steps", "20", "--save-every", "4", *TINY]
    run(DEEPSPEED, [*args, "--save-dir", "full", "--record", "full.json"], tmp_path)
    out = run(DEEPSPEED, [*args, "--save-dir", "ckpt", "--crash-at", "14"], tmp_path,
              expect_rc=3)
    assert "no checkpoint in ckpt: training from step 0" in out
    out = run(DEEPSPEED, [*args, "--save-dir", "ckpt", "--record", "resumed.json"], tmp_path)
    full, resumed = record(tmp_path / "full.json"), record(tmp_path / "resumed.json")
    assert resumed["start"] in (8, 12) and "resumed from" in out  # the newest committed
    assert_resumed_bitwise(resumed, full, 20)
    metrics = gockpt.metrics.read(str(tmp_path / "full"), rank=0)
    assert [m["final_step"] for m in metrics] == [4, 8, 12, 16, 20]
    assert {m["mode"] for m in metrics} == {"gockpt-o"}  # from the config's "gockpt" section
    assert len(list((tmp_path / "full").glob("step-*"))) == 3  # keep_last
    assert gockpt.verify(str(tmp_path / "ckpt")).ok


@pytest.mark.slow
def test_deepspeed_recipe_two_ranks_stopped_and_continued_bit_for_bit(tmp_path,
                                                                       deepspeed_installed):
    """Two gloo ranks (torchrun's environment), the shipped config with overlap_steps 3 added
    to its "gockpt" section, so that the expected checkpoints are copied over 3 steps and
    DeepSpeed's CPU Adam steps between are replayed; a run stopped after step 12 (its
    last save is completed at exit) continues from it in fresh processes."""
    with open(DS_CONFIG) as f:
        config = json.load(f)
    config["gockpt"]["overlap_steps"] = 3
    (tmp_path / "k3.json").write_text(json.dumps(config))
    args = ["--config", "k3.json", "--save-every", "4", *TINY]
    run(DEEPSPEED, [*args, "--steps", "16", "--save-dir", "full", "--record", "full-{rank}.json"],
        tmp_path, world=2)
    run(DEEPSPEED, [*args, "--steps", "12", "--save-dir", "ckpt"], tmp_path, world=2)
    out = run(DEEPSPEED, [*args, "--steps", "16", "--save-dir", "ckpt",
                          "--record", "resumed-{rank}.json"], tmp_path, world=2)
    assert "data position 12" in out
    for rank in (0, 1):
        full, resumed = (record(tmp_path / f"{run_}-{rank}.json") for run_ in ("full", "resumed"))
        assert resumed["start"] == 12
        assert_resumed_bitwise(resumed, full, 16)
    full_digests = {record(tmp_path / f"full-{r}.json")["digest"] for r in (0, 1)}
    assert len(full_digests) == 2  # each rank its own ZeRO partition
    metrics = gockpt.metrics.read(str(tmp_path / "full"), rank=0)
    # 4 and 8 asked without notice (copied at their step); 12 and 16 expected from the spacing
    assert [(m["final_step"], m["overlap_steps"], m["grad_steps"]) for m in metrics] == \
        [(4, 1, 0), (8, 1, 0), (12, 3, 2), (16, 3, 2)]
    assert gockpt.verify(str(tmp_path / "ckpt")).ok


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_dcp_recipe_killed_resumes_bit_for_bit(tmp_path, world):
    """The torchtitan-style recipe (dcp.async_save through GockptWriter every 4 steps, dcp.load
    through GockptReader at start; FSDP2 on 2 ranks): SIGKILL after step 13, the same command
    resumes from the newest committed checkpoint (8, or 12 if its write ended before the kill)
    and ends like the uninterrupted run on every rank; the checkpoints verify."""
    run(DCP, ["--save-dir", "full", "--record", "full-{rank}.json"], tmp_path, world)
    out = run(DCP, ["--save-dir", "ckpt", "--crash-at", "13"], tmp_path, world, expect_rc=-9)
    assert "step 13: crashing" in out
    out = run(DCP, ["--save-dir", "ckpt", "--record", "resumed-{rank}.json"], tmp_path, world)
    assert "resumed from" in out  # (rank 0's)
    for r in range(world):
        full, resumed = record(tmp_path / f"full-{r}.json"), record(tmp_path / f"resumed-{r}.json")
        assert resumed["start"] in (8, 12)
        assert_resumed_bitwise(resumed, full, 24)
    assert gockpt.storage.list_checkpoints(str(tmp_path / "full")) == [
        f"step-{s:09d}" for s in (16, 20, 24)]  # (keep_last=3)
    assert gockpt.verify(str(tmp_path / "ckpt")).ok


@pytest.mark.slow
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_framework_recipe_resumes_bit_for_bit_after_a_crash(tmp_path, framework):
    """Lightning's and the Hugging Face Trainer's recipes as shipped (gockpt-o, K=2, 24 steps,
    gradient accumulation, clipping, dropout; the Trainer's a checkpoint every 4 steps,
    Lightning's one per epoch of 8, as a plain DataLoader resumes exactly only there):
    killed with os._exit after step 13, the same command resumes from the newest committed
    checkpoint and ends like the uninterrupted run."""
    pytest.importorskip("pytorch_lightning" if framework == "lightning" else framework)
    script = FRAMEWORKS[framework]
    run(script, ["--save-dir", "full", "--record", "full.json"], tmp_path)
    out = run(script, ["--save-dir", "ckpt", "--crash-at", "13"], tmp_path, expect_rc=3)
    assert "step 13: crashing" in out
    out = run(script, ["--save-dir", "ckpt", "--record", "resumed.json"], tmp_path)
    full, resumed = record(tmp_path / "full.json"), record(tmp_path / "resumed.json")
    # the newest committed (12 only if its write ended before the crash)
    starts, saved = ((8,), [8, 16, 24]) if framework == "lightning" else \
        ((8, 12), [4, 8, 12, 16, 20, 24])
    assert resumed["start"] in starts and "resumed from ckpt" in out
    assert_resumed_bitwise(resumed, full, 24)
    assert [m["final_step"] for m in gockpt.metrics.read(str(tmp_path / "full"))] == saved
    assert gockpt.verify(str(tmp_path / "ckpt")).ok


def test_the_wheel_does_not_ship_the_recipes(monkeypatch):
    """setup.py packages gockpt (with gockpt.integrations, the importable integration) and
    nothing of the top-level integrations/."""
    import setuptools
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"))
    packages = seen["packages"]
    assert "gockpt.integrations.deepspeed" in packages
    assert all(p == "gockpt" or p.startswith("gockpt.") for p in packages), packages
    assert not any(seen.get(k) for k in ("py_modules", "data_files", "package_data",
                                         "include_package_data"))
