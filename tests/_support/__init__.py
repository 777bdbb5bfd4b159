"""The tests' shared helpers and subprocess workers, imported as ``tests._support.<module>``
(pytest puts the repository root on ``sys.path``: ``tests`` and its folders are packages).

Workers run in fresh processes as ``python -m tests._support.<worker>`` (:func:`worker_command`)
with the repository root on ``PYTHONPATH`` (:func:`worker_env`), so that they find ``gockpt``
and this package from any working directory.  Nothing here imports gockpt: the DeepSpeed
worker's "plain-load" run checks that gockpt is not imported."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_command(worker, *args):
    """``python -m tests._support.<worker> ARGS...`` with this interpreter."""
    return [sys.executable, "-m", f"{__name__}.{worker}", *map(str, args)]


def worker_env(**more):
    """The environment of a worker: this one, the repository root first on ``PYTHONPATH``
    (then this process's ``sys.path``), and ``more``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path), **more)
