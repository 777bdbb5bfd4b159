"""The run directory as a tier: where a load finds the checkpoint it holds (the writer and the
commit that put it there are :mod:`.writer` and :mod:`.commit`'s: the run directory is the
tier that commits, the others follow it). A run directory on local disk, or one in an object
store named by its ``s3://`` URL: both are found, and read, the same way."""

from __future__ import annotations

from typing import Optional

from ..core.errors import CheckpointNotFoundError
from .commit import checkpoint_of


class DiskReader:
    """Where a load finds a run's checkpoint in the run directory, a
    :class:`~gockpt.core.protocols.TierReader`: the one its ``latest`` names (or ``tag``)."""

    def __init__(self, tag: Optional[str] = None):
        self.tag = tag

    def newest(self, run: str, disk: Optional[str] = None) -> Optional[str]:
        """The checkpoint of run directory ``run`` (``disk`` is unused: this tier is the
        disk), None when it has none committed."""
        try:
            return self.find(run)
        except CheckpointNotFoundError:
            return None

    def find(self, path: str) -> str:
        """:meth:`newest` of a run directory, or ``path`` itself where it is one committed
        checkpoint; CheckpointNotFoundError saying what is there when neither."""
        return checkpoint_of(path, self.tag)
