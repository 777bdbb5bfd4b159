"""The object store as a tier (``Config.remote``): rank 0 uploads every committed checkpoint
of the run directory, every rank's part, in the background (:class:`.replicate.Replicator`);
the other ranks have nothing to do. A load finds a checkpoint there as in a run directory, by
its ``s3://`` URL (:class:`.disk_tier.DiskReader`), and reads it with the same reader."""

from __future__ import annotations

from typing import Callable, Optional

from ..core.latch import Latch
from ..core.protocols import Committed
from .replicate import RemoteStatus, Replicator


class RemoteTier:
    """Rank 0's uploads to ``url``, a :class:`~gockpt.core.protocols.Tier` (what an earlier
    process committed and did not upload is queued first)."""

    def __init__(self, directory: str, url: str, *, keep_last: Optional[int], retry_s: float,
                 wait_s: Optional[float],
                 yield_to: Callable[[], Optional[Latch]]):
        """``wait_s``: how long :meth:`finish` waits for the uploads the job owes
        (``Config.remote_wait_s``); ``yield_to``: the event ending the current checkpoint's
        copies, which the uploads wait for (they never slow the copies down)."""
        self.wait_s = wait_s
        self.replicator = Replicator(directory, url, keep_last=keep_last, retry_s=retry_s,
                                     yield_to=yield_to)
        self.replicator.resume()

    def publish(self, committed: Committed) -> None:
        """Queue the upload of the checkpoint just committed."""
        self.replicator.submit(committed.name)

    def finish(self, end_of_training: bool) -> None:
        """Wait for the uploads the job owes (at most ``wait_s``; what is left is said)."""
        self.replicator.close(self.wait_s)

    def stop(self) -> None:
        """Stop the uploads now."""
        self.replicator.close(0)

    def wait(self, timeout: Optional[float]) -> RemoteStatus:
        """Wait until every committed checkpoint is in the store (at most ``timeout`` s)."""
        self.replicator.wait(timeout)
        return self.replicator.status()

    def status(self) -> RemoteStatus:
        return self.replicator.status()
