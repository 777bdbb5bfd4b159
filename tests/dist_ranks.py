"""Starts a job of several ranks (gloo subprocesses running tests/dist_worker.py, as torchrun
would) and checks that every rank finished; shared by the storage and CLI tests."""

import os
import socket
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory, scenario, world=2, worker=WORKER, timeout=240):
    """Run ``worker DIRECTORY SCENARIO`` as ``world`` gloo ranks; returns (stdout, stderr) each."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join(sys.path))
        procs.append(subprocess.Popen([sys.executable, worker, str(directory), scenario],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out}\n{err}"
        assert f"rank {rank}: ok" in out
    return outs
