"""The loader fuzz test (tests/test_fuzz_load.py), longer: many seeded attacks on real
checkpoints, each followed by gockpt.load and gockpt.verify, which must give the identical
state or a gockpt error naming the damage (tests/_support/fuzz_attacks.py says what is attacked
and what is allowed).

    python experiments/fuzz_load.py --attacks 20000 [--seed 0] [--json OUT]

Prints the attacks by kind, the outcomes (identical state, gockpt error by class), and every
wrong outcome; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: gockpt, tests._support

import gockpt  # noqa: E402
from tests._support import fuzz_attacks as F  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attacks", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT", help="write the counts and wrong outcomes as JSON")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="gockpt-fuzz-")
    try:
        template = os.path.join(work, "template")
        F.make_template(template)
        refs = F.references(template)
        kinds, outcomes = collections.Counter(), collections.Counter()
        load = F.load_state

        def counted(run, **kw):  # what each load gave
            try:
                out = load(run, **kw)
            except gockpt.GockptError as exc:
                outcomes[type(exc).__name__] += 1
                raise
            outcomes["identical state"] += 1
            return out

        F.load_state = counted
        t0 = time.time()

        def progress(i, attack, why):
            kinds[attack.kind] += 1
            if (i + 1) % 1000 == 0:
                print(f"  {i + 1} attacks, {time.time() - t0:.0f} s", flush=True)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrong = F.run_attacks(template, work, args.seed, args.attacks, refs, progress)
        print(F.summary(args.attacks, wrong))
        print("attacks:  " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        print("outcomes: " + ", ".join(f"{k} {n}" for k, n in outcomes.most_common()))
        print(f"{time.time() - t0:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"attacks": args.attacks, "seed": args.seed, "kinds": kinds,
                           "outcomes": outcomes,
                           "wrong": [[a.kind, a.target, a.detail, why] for a, why in wrong]},
                          f, indent=1)
        return 1 if wrong else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
