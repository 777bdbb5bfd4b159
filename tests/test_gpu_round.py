"""The GPU round's driver and report (scripts/gpu_round.sh, experiments/gpu_report.py), checked
where they run every day: a lent GPU machine is rare, and a round whose script breaks there
wastes it. What needs the GPU itself is tests/gpu."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4"><testcase classname="tests.gpu.test_x" name="test_ok"/>
<testcase classname="tests.gpu.test_x" name="test_bad"><failure message="AssertionError: 3
elements differ">trace</failure></testcase><testcase classname="tests.gpu.test_x"
name="test_skip"><skipped message="no"/></testcase><testcase classname="tests.gpu.test_x"
name="test_ok2"/></testsuite></testsuites>"""


def test_the_report_puts_steps_failures_and_tables_together(tmp_path):
    (tmp_path / "versions.txt").write_text("3.11.7 2.11.0+cu130 13.0 NVIDIA H100 80GB HBM3\n")
    (tmp_path / "steps.tsv").write_text("step\trc\tseconds\tlimit\tlast line\n"
                                        "gpu_tests\t1\t93\t240\t1 failed, 2 passed\n"
                                        "bench_2.2b\t-\t-\t-\tnot run: out of time\n")
    (tmp_path / "gpu_tests.xml").write_text(JUNIT)
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite")  # a step cut off
    (tmp_path / "bench_370m.md").write_text("| run | blocked/ckpt |\n|---|---|\n| gockpt-o | 3.1 ms |\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_report.py"),
                          str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in report
    assert "| gpu_tests | 1 | 93 | 240 | 1 failed, 2 passed |" in report
    assert "not run: out of time" in report
    assert "`gpu_tests`: 2 passed, 1 failed, 0 errors, 1 skipped" in report
    assert "tests.gpu.test_x::test_bad: AssertionError: 3" in report
    assert "`cut`: unreadable" in report
    assert "## bench_370m" in report and "| gockpt-o | 3.1 ms |" in report


def test_the_round_reports_what_its_budget_leaves_out(tmp_path):
    """With no time left every step is reported as not run and counted as failed (the exit
    status), nothing is built, and the report is still written -- with the machine's python3,
    which here need not have torch (the report needs only the standard library). OUTDIR gets
    three files (a device call brings back 8): round.tgz with everything, the summary and the
    report."""
    import tarfile
    python3 = shutil.which("python3")
    out = tmp_path / "out"
    env = dict(os.environ, GPU_ROUND_BUDGET_S="0",
               PATH=os.pathsep.join([os.path.dirname(python3), os.environ.get("PATH", "")]))
    run = subprocess.run([os.path.join(ROOT, "run"), "gpu-check", str(out), "first", "second"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert sorted(os.listdir(out)) == ["report.md", "round.tgz", "summary.txt"], \
        run.stdout + run.stderr
    with tarfile.open(out / "round.tgz") as packed:
        steps_tsv = packed.extractfile("./steps.tsv").read().decode()
        report = packed.extractfile("./report.md").read().decode()
    steps = [line.split("\t") for line in steps_tsv.splitlines()[1:]]
    names = [s[0] for s in steps]
    assert {"build", "import", "gpu_tests", "golden_fresh", "bench_pinning", "bench_370m",
            "install", "gpu_deepspeed", "bench_370m_ds"} <= set(names)
    assert all(s[1] == "-" and s[4].startswith("not run: out of time") for s in steps)
    assert run.returncode == len(steps), run.stdout + run.stderr
    assert "not run: out of time" in report
    assert (out / "report.md").read_text() == report
