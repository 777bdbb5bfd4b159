"""pytest setup of the repository.  The tests import their shared helpers and workers as the
package ``tests._support`` (``tests`` and its folders are packages; pytest puts this directory
on ``sys.path``).

Tiers: ``pytest -m "not slow" tests`` is the inner loop of development (a few minutes on a
2-core machine); ``./run test`` runs all of ``tests/``, the ``slow`` tests included."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: end-to-end tests that take long (subprocess ranks, DeepSpeed, crash and "
        "fuzz runs); deselect with -m \"not slow\"")
