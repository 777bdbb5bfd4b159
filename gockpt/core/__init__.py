"""The words every stage shares, imported by all and importing none of them (see
docs/architecture.md): errors, options and modes, slots, blocks and the plan, host arenas,
the digest, step records, one checkpoint in flight (the job) and its metrics."""

from .lazy import submodule


def __getattr__(name: str):  # (a submodule, imported when first named: core/lazy.py)
    return submodule(__name__, name)
