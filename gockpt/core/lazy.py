"""A package's submodules imported when first named: ``import gockpt`` imports the engine only
where it is first used (a tool without torch starts without it), so ``gockpt.storage.tree``
after a plain ``import gockpt`` -- reachable before, when the package imported most modules --
is found by the packages' ``__getattr__`` (PEP 562) through :func:`submodule`."""

from __future__ import annotations

import importlib
import importlib.util


def submodule(package: str, name: str):
    """The submodule ``name`` of ``package`` (imported now); AttributeError as for any missing
    attribute where there is none (``hasattr`` stays False for a dotted or dunder name)."""
    if name.isidentifier() and not name.startswith("__"):
        try:
            found = importlib.util.find_spec(f"{package}.{name}") is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
