"""Starts a job of several ranks (gloo processes running ``tests._support.dist_worker`` or
another worker, as torchrun would start them, forked from the session's server that imported
torch and DeepSpeed once: tests._support.forked) and checks that every rank finished; shared
by the storage, CLI, DeepSpeed and many-ranks tests."""

import time

from tests._support import worker_env
from tests._support.forked import Forked
from tests._support.ports import free_ports

WORKER = "dist_worker"  # a module of tests._support


def free_port():
    """A free port for a job's rendezvous (:mod:`tests._support.ports`)."""
    return free_ports(1)


def start_ranks(directory, scenario, world=2, worker=WORKER):
    """Start ``python -m tests._support.<worker> DIRECTORY SCENARIO`` as ``world`` gloo ranks,
    forked from the session's server that imported torch and DeepSpeed once
    (:mod:`tests._support.forked`); returns their processes (``Popen``-like, text output)."""
    return fork_ranks(worker, [str(directory), scenario], world)


def fork_ranks(worker, args, world, **env):
    """``world`` gloo ranks of ``python -m tests._support.<worker> ARGS`` (a ``worker`` path
    ending in ``.py``: that script), forked, with torchrun's rendezvous variables and ``env``
    in their environment; returns their processes."""
    port = free_port()
    return [Forked(worker, args,
                   worker_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port), **env))
            for rank in range(world)]


# Once one rank has failed, how long the others get to end by themselves (as gockpt's exit
# work makes them) before they are killed: a failed rank fails the test at once, not after
# ``timeout``, with what every rank printed.
AFTER_A_FAILURE_S = 60


def run_ranks(directory, scenario, world=2, worker=WORKER, timeout=240):
    """:func:`start_ranks` and check that every rank finished; returns (stdout, stderr)
    each."""
    procs = start_ranks(directory, scenario, world, worker)
    deadline = time.monotonic() + timeout
    try:
        while True:
            running = [p for p in procs if p.poll() is None]
            if not running:
                break
            if any(p.returncode for p in procs):
                deadline = min(deadline, time.monotonic() + AFTER_A_FAILURE_S)
            if time.monotonic() >= deadline:
                break
            running[0].join(min(1.0, max(0.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            p.kill()
    outs = [p.communicate() for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (f"rank {rank} ended with {p.returncode} (-9: killed "
                                   f"after {timeout} s, or {AFTER_A_FAILURE_S} s after another "
                                   f"rank failed):\n{out}\n{err}")
        assert f"rank {rank}: ok" in out
    return outs
