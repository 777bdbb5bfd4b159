"""Subprocess of test_resume: trains with checkpoints and kills itself with SIGKILL, or
resumes from the latest checkpoint; prints JSON (losses, digest of the final state)."""

import json
import os
import signal
import sys

import gockpt
from tests._support import harness as H


def main():
    phase, directory, mode, total, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], \
        int(sys.argv[4]), int(sys.argv[5])
    H.seed_all(0)
    model, opt, sched = H.build()
    if phase == "train":
        ck = gockpt.Checkpointer(model, opt, directory, mode=mode, overlap_steps=3,
                                 scheduler=sched, block_bytes=512, interval=5)
        losses = H.train_steps(model, opt, sched, 0, kill_at, ck)
        # let the last started checkpoint become durable, then die mid-step with more in flight
        print(json.dumps({"losses": losses}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    start = 0
    if phase == "resume":
        restored = gockpt.load(directory, model, opt, scheduler=sched)
        start = restored.step
    losses = H.train_steps(model, opt, sched, start, total)
    print(json.dumps({"start": start, "losses": losses, "digest": H.state_digest(model, opt)}))


if __name__ == "__main__":
    main()
