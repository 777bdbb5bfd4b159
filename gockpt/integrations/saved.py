"""What a framework's integration reads of a gockpt checkpoint before its model and optimizer
exist: the checkpoint a path names and the ``extra_state`` it holds (the framework's own loop
state), every byte checked."""

from __future__ import annotations

import os

from ..storage import read_manifest, read_tensors
from ..storage.commit import checkpoint_of
from ..storage.manifest import parse
from ..storage.schema import is_small_tensor


def extra_state_of(path: str | os.PathLike) -> tuple[str, object]:
    """(the checkpoint directory ``path`` names -- a run directory's ``latest`` or a
    checkpoint's own directory --, the ``extra_state`` of its first part, decoded).
    CheckpointNotFoundError / CorruptCheckpointError as :func:`gockpt.load` raises them."""
    top = checkpoint_of(os.path.realpath(os.fspath(path)))
    data = read_manifest(top)
    part = os.path.join(top, data["ranks"][0]) if "ranks" in data else top
    m = parse(part, read_manifest(part))
    small = read_tensors(part, m, [n for n in m.tensors if is_small_tensor(n)], verify=True)
    return top, m.small.decode("extra_state", small)
