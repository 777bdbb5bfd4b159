"""Subprocess of test_gpu_checkpoints: trains on the GPU with checkpoints and kills itself, or
resumes from the latest; prints JSON (losses, digest of the final state)."""

import json
import os
import signal
import sys

import gockpt
from tests._support import gpu_common as G
from tests._support import harness as H


def main():
    phase, directory, impl, total, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], \
        int(sys.argv[4]), int(sys.argv[5])
    model, opt, sched = G.build(impl)
    if phase == "train":
        ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=3,
                                 scheduler=sched, interval=4, block_bytes=4096)
        losses = G.train(model, opt, sched, 0, kill_at, ck)
        print(json.dumps({"losses": losses}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    start = 0
    if phase == "resume":
        start = gockpt.load(directory, model, opt, scheduler=sched).step
    losses = G.train(model, opt, sched, start, total)
    print(json.dumps({"start": start, "losses": losses, "digest": H.state_digest(model, opt)}))


if __name__ == "__main__":
    main()
