"""Rank processes forked from one server that imported torch (with torch._dynamo, which the
first optimizer imports), DeepSpeed and gockpt once per test session (:data:`PRELOAD`): a rank's
process then starts in a tenth of a second instead of 4-6 s of imports, which were most of the
multi-rank tests' time.

Each is still its own process -- fresh memory, its own torch.distributed state, DeepSpeed's
per-process CPU Adam state made anew (the resumes across processes stay real resumes) -- run as
``python -m tests._support.<worker> ARGS`` would be: ``sys.argv``, the environment, stdout and
stderr of its own, an uncaught exception printed with its traceback (``sys.last_value`` set) and
exit status 1, ``SystemExit``'s status, then the ``atexit`` handlers. What it does not reproduce
is the interpreter's own finalization after those, nor its imports: the tests of what a
process does at its end (tests/test_exit.py) start real interpreters
(:func:`tests._support.worker_command`), and so do those of what ``import gockpt`` imports
(tests/test_import_cost.py).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Optional

# What the workers import, once here: DeepSpeed's ZeRO optimizer check imports its Muon
# optimizer in every engine's construction, which imports torch's inductor (2.3 s of each
# DeepSpeed rank's start); gockpt itself with DCP, DTensor and FSDP2 (about a second of each
# rank's start: a fifth of the test suite's CPU time). A worker that must run without gockpt
# drops it from ``sys.modules`` first (tests/_support/deepspeed_worker.py's plain-load).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "numpy", "deepspeed",
           "deepspeed.runtime.zero.muon.muon_optimizer", "pytorch_lightning",
           "torch.distributed.checkpoint", "torch.distributed.tensor",
           "torch.distributed.fsdp", "gockpt", "gockpt.checkpointer", "gockpt.loading",
           "gockpt.storage",
           "gockpt.integrations.deepspeed", "gockpt.integrations.lightning",
           "tests._support.cpu_probe"]

_context = None
_outputs = None  # the folder of the workers' outputs, removed when this process ends


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([m for m in PRELOAD if _importable(m)])
    return _context


def _importable(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _child(module: str, args: list, env: dict, out_path: str, err_path: str,
           cwd: Optional[str] = None) -> None:
    """In the forked process: the worker as ``python -m`` would run it (a path ending in
    ``.py``: the script, as ``python PATH`` would), in ``cwd`` when given."""
    # The half million objects of the preloaded modules out of the collector's sight: a full
    # collection (DeepSpeed's BF16 optimizer forces four in its construction) then walks only
    # the worker's own objects, not the server's too.
    gc.freeze()
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # (torch's threads, as a fresh interpreter's
        import torch                                # torch takes them from it at its import)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for path in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # multiprocessing's default start method as a fresh interpreter has it (the server's
    # start set it to "forkserver": a DataLoader's workers would run the worker's script again)
    multiprocessing.set_start_method(None, force=True)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [module, *args]
    code = 0
    try:
        if module.endswith(".py"):  # (its folder first on sys.path, as python PATH puts it)
            sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter does with an uncaught exception
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _output_dir() -> str:
    global _outputs
    if _outputs is None:
        _outputs = tempfile.mkdtemp(prefix="gockpt-forked-")
        atexit.register(shutil.rmtree, _outputs, True)
    return tempfile.mkdtemp(dir=_outputs)


class Forked:
    """``python -m tests._support.<worker> ARGS`` forked, used like its ``subprocess.Popen``
    (text output; with ``stream``, ``stdout`` is a pipe read as it writes, as ``stdout=PIPE``
    gives). ``worker`` a path ending in ``.py``: ``python PATH ARGS`` (the recipes), in
    ``cwd`` when given."""

    def __init__(self, worker: str, args: list, env: dict, stream: bool = False,
                 cwd: Optional[str] = None):
        module = worker if worker.endswith(".py") else f"{__package__}.{worker}"
        self._dir = _output_dir()
        self._out = os.path.join(self._dir, "stdout")
        self._err = os.path.join(self._dir, "stderr")
        if stream:
            os.mkfifo(self._out)
        self._proc = _forkserver().Process(target=_child,
                                           args=(module, list(args), dict(env), self._out,
                                                 self._err, None if cwd is None else str(cwd)))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: Optional[int] = None
        # (opening a pipe waits for its writer: the child opens it first thing)
        self.stdout = open(self._out, errors="replace") if stream else None

    @property
    def stderr(self):
        """What it wrote to stderr so far, as a file to read."""
        return open(self._err, errors="replace")

    def poll(self) -> Optional[int]:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def join(self, timeout: float) -> None:
        """Wait until it ends or ``timeout`` seconds pass, whichever is first."""
        self._proc.join(timeout)

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        """Wait for the end, then (stdout, stderr) as text."""
        self.wait(timeout)
        out = self.stdout.read() if self.stdout is not None else self._read(self._out)
        return out, self._read(self._err)

    def kill(self) -> None:
        if self.poll() is None:
            self._proc.kill()
            deadline = time.monotonic() + 30
            while self.poll() is None and time.monotonic() < deadline:
                self._proc.join(0.1)

    @staticmethod
    def _read(path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()


def run_worker(worker: str, *args, env: dict, timeout: float):
    """``subprocess.run(worker_command(worker, *args), capture_output=True, text=True)``,
    forked (:class:`Forked`): a ``CompletedProcess``."""
    proc = Forked(worker, [str(a) for a in args], env)
    try:
        out, err = proc.communicate(timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess([worker, *map(str, args)], proc.returncode, out, err)
