"""Capture: copies of the live state to host memory, in groups over a window, and the
gradients between."""

from ..core.lazy import submodule


def __getattr__(name: str):  # (a submodule, imported when first named: core/lazy.py)
    return submodule(__name__, name)
