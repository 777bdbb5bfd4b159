"""The goodput accounting (gockpt.goodput) of the records a run's processes leave in
metrics.jsonl, and ``gockpt goodput``: every second of wall time in exactly one category."""

import json
import os

import pytest

from gockpt import goodput
from gockpt.cli import main as cli_main
from gockpt.core import runlog
from gockpt.core.errors import ConfigError


def rec(kind, pid, start, t, **fields):
    return {"record": kind, "pid": pid, "process_start": start, "time": t, "rank": 0, **fields}


def ckpt(pid, start, final_step, final_time, blocked, committed):
    return {"pid": pid, "process_start": start, "time": committed, "rank": 0,
            "final_step": final_step, "final_time": final_time, "blocked_s": blocked}


# Process 1 starts at 0, trains from 2 s, checkpoints step 10 at 5 s (0.5 s blocked) and
# step 20 at 9 s (0.5 s), is last heard of at 11 s (step 25) and killed. Process 2 starts at
# 12 s, loads step 20 (done at 15 s), trains to step 40, its boundary at 21 s, checkpoints
# step 30 at 18 s (0.25 s blocked), closes at 22 s after completing its last checkpoint.
RUN = [
    rec("start", 1, 0.0, 2.0, world_size=1),
    ckpt(1, 0.0, 10, 5.0, 0.5, 5.5),
    ckpt(1, 0.0, 20, 9.0, 0.5, 9.5),
    rec("progress", 1, 0.0, 11.0, step=25),
    rec("load", 2, 12.0, 15.0, step=20, time_start=14.0),
    rec("start", 2, 12.0, 14.5, world_size=1),
    ckpt(2, 12.0, 30, 18.0, 0.25, 18.5),
    rec("end", 2, 12.0, 22.0, step=40, boundary_time=21.0),
    {"record": "checkpoint", "pid": 1, "process_start": 0.0, "time": 5.5, "rank": 1,
     "final_step": 10, "final_time": 5.0, "blocked_s": 9.0},  # another rank's: not counted
]


def test_each_category_is_what_the_records_say():
    g = goodput.account(RUN)
    assert (g.attempts, g.failures, g.final_step, g.checkpoints, g.interval_steps) == \
        (2, 1, 40, 3, 10.0)
    assert g.wall_s == 22.0
    expected = {
        "restore": 2.0 + 3.0,                         # 0 -> 2 s, 12 -> 15 s (the load's end)
        "checkpoint": 0.5 + 0.5 + 0.25 + 1.0,         # blocked, and close() from 21 to 22 s
        "productive": (9.0 - 2.0 - 1.0) + (21.0 - 15.0 - 0.25),  # to step 20's boundary; all
        "wasted": 11.0 - 9.0,                         # steps 20 -> 25, computed again
        "other": 12.0 - 11.0,                         # last heard of -> the next start
    }
    assert g.seconds == pytest.approx(expected)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert g.goodput == pytest.approx(expected["productive"] / 22.0)


def test_a_restart_from_an_older_checkpoint_wastes_everything_after_it():
    # the second process loads step 10 (step 20's checkpoint was lost): 9 -> 11 s and the
    # steps from 10 to 20 (5 -> 9 s, less the blocked 0.5 s of step 20) are wasted
    run = [r if r.get("record") != "load" else dict(r, step=10) for r in RUN]
    g = goodput.account(run)
    assert g.seconds["wasted"] == pytest.approx(11.0 - 5.0 - 0.5)
    assert g.seconds["productive"] == pytest.approx((5.0 - 2.0 - 0.5) + (21.0 - 15.0 - 0.25))
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_no_record_of_a_process_start_says_so():
    with pytest.raises(ConfigError, match="no process of the job recorded its start"):
        goodput.account([{"final_step": 3, "blocked_s": 0.1}])  # an older gockpt's records


def test_the_command_prints_the_table_the_json_and_the_plot(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RUN))
    assert cli_main(["goodput", str(tmp_path), "--json", "--plot", str(tmp_path / "g.png")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seconds"] == pytest.approx(goodput.account(RUN).seconds)
    assert (tmp_path / "g.png").stat().st_size > 0
    assert cli_main(["goodput", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "goodput 53.4%" in out  # 11.75 s of 22 and "1 failure(s) over 2 process(es)" in out
    assert cli_main(["goodput", str(tmp_path / "nothing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    os.mkdir(tmp_path / "empty")
    assert cli_main(["goodput", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_process_knows_when_it_started():
    me = runlog.identity()
    assert me["pid"] == os.getpid()
    assert 0 < me["process_start"] <= __import__("time").time()


def test_a_process_that_died_loading_does_not_decide_what_was_kept():
    # between process 1 and 2, one started at 11.5 s and died loading at 11.8 s: what process
    # 1 kept is still what process 2 went on from (step 20), and that process's life is restore
    died = rec("loading", 3, 11.5, 11.8)
    g = goodput.account(RUN + [died])
    base = goodput.account(RUN)
    assert (g.attempts, g.failures) == (3, 2)
    assert g.seconds["productive"] == pytest.approx(base.seconds["productive"])
    assert g.seconds["wasted"] == pytest.approx(base.seconds["wasted"])
    assert g.seconds["restore"] == pytest.approx(base.seconds["restore"] + 0.3)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_a_job_cut_after_a_failure_keeps_its_last_checkpoint():
    g = goodput.account([r for r in RUN if r.get("pid") == 1])  # process 1 only, killed
    assert g.seconds["productive"] == pytest.approx(9.0 - 2.0 - 1.0)  # to step 20's boundary
    assert g.seconds["wasted"] == pytest.approx(11.0 - 9.0)


def test_a_restart_from_the_step_log_keeps_the_steps_it_replayed():
    # the second process resumes at step 24 (the memory tier's log replayed 21..24, beyond
    # step 20's checkpoint): process 1 reached step 24 between its records of step 20 (9 s)
    # and step 25 (11 s), at 10.6 s by their pace; only 10.6 -> 11 s is computed again
    run = [dict(r, step=24) if r.get("record") == "load" else r for r in RUN]
    g = goodput.account(run)
    kept_until = 9.0 + (11.0 - 9.0) * (24 - 20) / (25 - 20)
    assert g.seconds["wasted"] == pytest.approx(11.0 - kept_until)
    assert g.seconds["productive"] == pytest.approx(
        (kept_until - 2.0 - 1.0) + (21.0 - 15.0 - 0.25))
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
