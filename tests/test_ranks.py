"""Transitional: tests/test_cli.py still does ``from test_ranks import run_ranks``. The rank
tests moved to tests/storage/test_storage_ranks.py and the helper to tests/dist_ranks.py;
delete this file once test_cli.py imports ``from dist_ranks import run_ranks``."""

from dist_ranks import run_ranks  # noqa: F401
