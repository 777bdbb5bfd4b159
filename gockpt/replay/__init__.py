"""Replay: every block brought from the version it was copied at to version F, bitwise."""

from ..core.lazy import submodule


def __getattr__(name: str):  # (a submodule, imported when first named: core/lazy.py)
    return submodule(__name__, name)
