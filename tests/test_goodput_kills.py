"""Exactness under real crashes, restarted by the launcher users use (``torchrun
--max-restarts``): the goodput benchmark's worker (experiments/goodput_worker.py) killed with
SIGKILL at three chosen points -- inside a checkpoint's window, while persisting a checkpoint,
inside a restart's load -- ends at the state of the uninterrupted run, bit for bit, on 1 and on
2 ranks; and ``gockpt goodput``'s accounting of the killed run (from gockpt's own records)
agrees with the benchmark's (from its kill times and its per-step logs)."""

import os
import subprocess
import sys

import pytest
import torch

from gockpt import goodput
from gockpt.core import runlog
from gockpt.testing import first_difference

from tests._support import REPO
from tests._support.dist_ranks import fork_ranks

sys.path.insert(0, os.path.join(REPO, "experiments"))
import goodput as bench  # noqa: E402  (experiments/goodput.py)

pytestmark = pytest.mark.slow

STEPS, EVERY, K = 30, 5, 3
# attempt 0 dies at the boundary of step 9 (step 10's window open, step 5 committed);
# attempt 1 resumes at 5 and dies writing step 20; attempt 2 dies loading step 15;
# attempt 3 resumes at 15 and finishes
DIE = "window@9,persist@20,load"


WORKER = os.path.join(REPO, "experiments", "goodput_worker.py")


def worker_args(directory, *extra):
    return [str(directory), "--steps", str(STEPS), "--every", str(EVERY), "--k", str(K),
            "--dim", "64", "--layers", "2", "--final", str(directory), *extra]


def torchrun(directory, ranks, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "--max-restarts=5", "--monitor-interval=0.1",
           WORKER, *worker_args(directory, *extra)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **bench.RESTARTABLE)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]


def uninterrupted(directory, ranks):
    """The reference: the same job without checkpoints or kills, its ranks forked
    (tests/_support/forked.py) with torchrun's environment -- one intra-op thread each, as
    torchrun gives its workers -- instead of started by a launcher: nothing of its end state
    depends on the launcher, and a launcher and fresh interpreters cost 10-15 s of CPU here."""
    procs = fork_ranks(WORKER, worker_args(directory, "--scheme", "none"), ranks,
                       OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=400)
            assert p.returncode == 0, f"reference rank {r}: {out[-2000:]}\n{err[-4000:]}"
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("ranks", [1, 2])
def test_three_kills_end_at_the_uninterrupted_state_and_the_accountings_agree(tmp_path, ranks):
    ref, run = tmp_path / "reference", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    uninterrupted(ref, ranks)
    torchrun(run, ranks, "--scheme", "gockpt-o", "--die", DIE)

    logs = bench.read_logs(str(run))
    assert [p.get("died") is not None for p in logs] == [True, True, True, False]
    assert [p["restored"] for p in logs] == [0, 5, 0, 15]  # (attempt 2 never got ready)
    assert logs[2]["ready"] is None
    for r in range(ranks):
        diff = first_difference(torch.load(run / f"final-rank{r}.pt", weights_only=False),
                                torch.load(ref / f"final-rank{r}.pt", weights_only=False),
                                f"rank {r}")
        assert diff is None, diff

    mine, landed, _ = bench.account({"logs": logs, "kills": []}, EVERY, K)
    theirs = goodput.read(str(run))
    assert landed == ["window", "checkpoint in flight", "restore (start or load)"]
    assert (theirs.failures, theirs.attempts, theirs.final_step) == (3, 4, STEPS)
    assert mine.final_step == STEPS and mine.failures == 3
    for g in (mine, theirs):
        assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    # What only one side can see: gockpt's last record of a killed process is at most a
    # progress interval and a step before its death; the hooks' time outside checkpoints.
    longest_step = max(t1 - t0 for p in logs
                       for (_, t0, _, _), (_, t1, _, _) in zip(p["steps"], p["steps"][1:]))
    tol = 3 * (runlog.PROGRESS_EVERY_S + longest_step) + 0.1
    assert abs(mine.wall_s - theirs.wall_s) <= tol
    for category in ("productive", "checkpoint", "restore"):
        assert abs(mine.seconds[category] - theirs.seconds[category]) <= tol, category
    lost = ("wasted", "other")
    assert abs(sum(mine.seconds[c] for c in lost) - sum(theirs.seconds[c] for c in lost)) <= tol
