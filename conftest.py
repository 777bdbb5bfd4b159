"""pytest setup of the repository.  The tests import their shared helpers and workers as the
package ``tests._support`` (``tests`` and its folders are packages; pytest puts this directory
on ``sys.path``).

Tiers: ``pytest -m "not slow" tests`` is the inner loop of development (a few minutes on a
2-core machine); ``./run test`` runs all of ``tests/``, the ``slow`` tests included.

The session's environment, inherited by every worker process: DeepSpeed compiles some of its
ops the first time a process uses them (on the CPU its FusedAdam and shared-memory collectives,
about a minute and a half); scripts/bootstrap.sh builds them once into ``torch_extensions``
beside this interpreter (the venv), and the tests look there, so that no rank compiles them
under a test's time limit nor waits forever on the lock of a build that was killed. Torch
builds with ``ninja``, which pip installs into the venv's ``bin``: that folder goes first on
``PATH`` even where the venv is not activated.

OpenMP's threads of every test process sleep as soon as they are idle
(``OMP_WAIT_POLICY=PASSIVE``, read by libgomp when torch loads it, so set before any import of
torch): by default each of torch's intra-op threads spins after every parallel region, and
with two pytest workers and their rank processes on two cores that spinning took the CPU the
other processes needed -- the suite 9:21 -> 7:17 here, its CPU time 1,068 -> 799 s. Where the
threads wait changes no result: how an op splits its work depends on the number of threads,
not on how idle ones wait."""

import os
import sys

# fixtures of a real S3 store (``server``, ``url``) for the modules that ask for them
pytest_plugins = ["tests._support.s3_fixtures"]

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_BIN = os.path.dirname(sys.executable)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join([_BIN, os.environ.get("PATH", "")])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: end-to-end tests that take long (subprocess ranks, DeepSpeed, crash and "
        "fuzz runs); deselect with -m \"not slow\"")
