"""Put one GPU round's results together: OUTDIR/report.md from what scripts/gpu_round.sh wrote.

    python3 experiments/gpu_report.py OUTDIR

The machine (versions.txt, nvidia-smi.txt), each step's exit status and time (steps.tsv), the
tests per pytest report (passed, failed, skipped, and each failure's first line), and the
benchmarks' markdown tables and the remote tier's numbers, in that order: the page docs/gpu.md
is written from.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine(out: str) -> list:
    lines = ["## Machine", "", "python, torch, CUDA, device: `" +
             (_read(os.path.join(out, "versions.txt")).strip() or "unknown") + "`", ""]
    smi = _read(os.path.join(out, "nvidia-smi.txt")).strip().splitlines()
    if smi:
        lines += ["```"] + smi[:12] + ["```", ""]
    return lines


def steps(out: str) -> list:
    rows = [r.split("\t") for r in _read(os.path.join(out, "steps.tsv")).splitlines()[1:] if r]
    lines = ["## Steps", "", "| step | exit | seconds | limit | last line |", "|---|---|---|---|---|"]
    for r in rows:
        r = (r + [""] * 5)[:5]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in r) + " |")
    return lines + [""]


def tests(out: str) -> list:
    lines = ["## Tests", ""]
    for name in sorted(n for n in os.listdir(out) if n.endswith(".xml")):
        try:
            root = ET.parse(os.path.join(out, name)).getroot()
        except ET.ParseError:
            lines.append(f"- `{name[:-4]}`: unreadable (the step was cut off?)")
            continue
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            continue
        count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
        lines.append(f"- `{name[:-4]}`: {passed} passed, {count['failures']} failed, "
                     f"{count['errors']} errors, {count['skipped']} skipped")
        for case in suite.iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                first = (bad.get("message") or "").strip().splitlines()[:1]
                lines.append(f"  - {case.get('classname')}::{case.get('name')}: "
                             f"{first[0][:300] if first else bad.tag}")
    return lines + [""]


def benches(out: str) -> list:
    lines = []
    for name in sorted(n for n in os.listdir(out) if n.startswith("bench_") and n.endswith(".md")):
        lines += [f"## {name[:-3]}", "", _read(os.path.join(out, name)).strip(), ""]
    for name in sorted(n for n in os.listdir(out)
                       if n.startswith("bench_remote_") and n.endswith(".json")):
        try:
            data = json.loads(_read(os.path.join(out, name)))
        except ValueError:
            continue
        lines += [f"## {name[:-5]}", "", "```", json.dumps(data, indent=1)[:4000], "```", ""]
    return lines


def write(out: str) -> str:
    page = ["# GPU round", ""] + machine(out) + steps(out) + tests(out) + benches(out)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(page) + "\n")
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python3 experiments/gpu_report.py OUTDIR", file=sys.stderr)
        return 2
    print("wrote", write(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
