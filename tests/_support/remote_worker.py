"""Subprocess of tests/test_remote.py (the S3 server's AWS_* variables in its environment).

    train DIR URL TOTAL KILL_AT   gockpt-o with the remote tier; checkpoints every 5 steps; at
                                  KILL_AT waits until the store holds them all, prints the
                                  losses and dies (SIGKILL)
    hang DIR URL TOTAL            the same, but the upload of the second checkpoint stops at its
                                  manifest, its data in the store (prints "uploading <name>" and
                                  blocks): the parent kills this process mid-upload
    upload DIR URL                a Checkpointer opened on DIR with the remote tier and closed,
                                  waiting for the uploads: what an earlier run left is uploaded
    resume SOURCE TOTAL           gockpt.load(SOURCE) (a directory or an s3:// URL), train on to
                                  TOTAL, print the losses and the digest of the final state
    straight TOTAL                TOTAL steps without checkpoints (the uninterrupted run)
    dcp DIR URL TOTAL             TOTAL steps, a dcp.save through GockptWriter(remote=URL) after
                                  each; prints the final state's digest and returns at once:
                                  the process's end waits for the uploads
"""

import json
import os
import signal
import sys
import threading

import gockpt
from gockpt.storage import remote
from tests._support import harness as H


def checkpointer(model, opt, sched, directory, url):
    return gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=3,
                               scheduler=sched, block_bytes=512, interval=5, remote=url,
                               remote_retry_s=0.05)


class HangsInSecondCheckpoint(remote.Bucket):
    """Blocks for good at the put of the second uploaded checkpoint's manifest: its data
    objects are in the store, the checkpoint is not."""

    seen: list = []

    def put_file(self, key, path, **kw):
        name, file = key.split("/")[-2:]
        if name not in self.seen:
            self.seen.append(name)
        if len(self.seen) == 2 and file == "manifest.json":
            print(f"uploading {name}", flush=True)
            threading.Event().wait()
        return super().put_file(key, path, **kw)


def main():
    phase, args = sys.argv[1], sys.argv[2:]
    H.seed_all(0)
    model, opt, sched = H.build()
    if phase in ("train", "hang"):
        directory, url, total = args[0], args[1], int(args[2])
        if phase == "hang":
            remote.register(url, factory=HangsInSecondCheckpoint)
        ck = checkpointer(model, opt, sched, directory, url)
        kill_at = int(args[3]) if phase == "train" else total
        losses = H.train_steps(model, opt, sched, 0, kill_at, ck)
        if phase == "train":
            status = ck.wait_remote()
            assert not status.pending and status.error is None, status
        if phase == "hang":
            ck.wait()  # committed locally; its upload hangs until the parent kills this process
            threading.Event().wait()
        print(json.dumps({"losses": losses}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if phase == "upload":
        directory, url = args
        ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", scheduler=sched,
                                 remote=url, remote_wait_s=None)
        ck.close()
        print(json.dumps({"uploaded": ck.remote_status().uploaded,
                          "records": gockpt.metrics.read(directory, record="upload")}))
        return
    if phase == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from gockpt.storage.dcp import GockptWriter
        directory, url, total = args[0], args[1], int(args[2])
        for step in range(total):
            H.train_steps(model, opt, sched, step, step + 1)
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optimizer": optim_sd},
                     storage_writer=GockptWriter(directory, step=step + 1, remote=url))
        print(json.dumps({"digest": H.state_digest(model, opt)}))
        return
    start = 0
    if phase == "resume":
        restored = gockpt.load(args[0], model, opt, scheduler=sched)
        start = restored.step
    total = int(args[-1])
    losses = H.train_steps(model, opt, sched, start, total)
    print(json.dumps({"start": start, "losses": losses, "digest": H.state_digest(model, opt)}))


if __name__ == "__main__":
    main()
