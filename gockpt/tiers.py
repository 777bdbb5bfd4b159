"""The tiers beyond the run directory on local disk, side by side: the memory tier (host shared
memory, every rank: ``Config.memory``, :mod:`gockpt.storage.memory_tier`) and the remote tier
(an object store, rank 0 uploading every rank's part: ``Config.remote``,
:mod:`gockpt.storage.replicate`). What a Checkpointer asks of them, in one place: making them
(agreed by every rank), a committed checkpoint handed on, what they owe at the end of a job,
stopping, and the remote tier's status. (The persist thread writes the memory copy itself,
from the host copy it has just committed.)"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from .core.config import Config
from .core.errors import ConfigError
from .storage import memory_tier, remote
from .storage.memory_tier import MemoryTier
from .storage.ranks import Ranks
from .storage.replicate import RemoteStatus, Replicator


class Tiers:
    """The memory and remote tiers of one Checkpointer (built on every rank, together)."""

    def __init__(self, config: Config, ranks: Ranks, state_bytes: int,
                 copies_in_progress: Callable[[], Optional[threading.Event]]):
        """``state_bytes``: one checkpoint of this rank (the memory tier's space);
        ``copies_in_progress``: the event ending the current checkpoint's copies, which the
        uploads wait for (they never slow the copies down)."""
        self.config = config
        self.memory: Optional[MemoryTier] = None
        if config.memory is not None:
            self.memory = _memory_tier(config, ranks, state_bytes)
        self.replicator: Optional[Replicator] = None
        if config.remote is not None:
            remote.register(config.remote, config.remote_options)
            if ranks.rank == 0:
                self.replicator = Replicator(config.directory, config.remote,
                                             keep_last=config.remote_keep_last,
                                             retry_s=config.remote_retry_s,
                                             yield_to=copies_in_progress)
                self.replicator.resume()

    def committed(self, name: str) -> None:
        """Checkpoint ``name`` is committed on disk (persist thread): queue its upload."""
        if self.replicator is not None:
            self.replicator.submit(name)

    def finish(self, end_of_training: bool) -> None:
        """``close()``: wait for the uploads the job owes (``Config.remote_wait_s``) and, at the
        end of training, remove the memory copies (the disk holds them); a process leaving on
        an exception keeps them for its restart."""
        if self.replicator is not None:
            self.replicator.close(self.config.remote_wait_s)
        if self.memory is not None and end_of_training:
            self.memory.remove()

    def stop(self) -> None:
        """Stop the uploads now (the end of ``close()`` and ``abort()``)."""
        if self.replicator is not None:
            self.replicator.close(0)

    def wait_remote(self, timeout: Optional[float]) -> Optional[RemoteStatus]:
        """Wait until every committed checkpoint is in the store (at most ``timeout`` s)."""
        if self.replicator is None:
            return None
        self.replicator.wait(timeout)
        return self.replicator.status()

    def remote_status(self) -> Optional[RemoteStatus]:
        return None if self.replicator is None else self.replicator.status()


def _memory_tier(config: Config, ranks: Ranks, state_bytes: int) -> Optional[MemoryTier]:
    """The memory tier of ``Config.memory``, agreed on by every rank (None: off). On several
    hosts each rank's part is also kept by a rank on the next host (:mod:`.storage.peers`):
    a host holds its own ranks' parts and those it keeps."""
    hosts = ranks.hosts(memory_tier.host_id())
    error, limit = None, None
    try:
        limit = memory_tier.budget(config.memory, config.memory_dir,
                                   ranks.agree_max(state_bytes),
                                   hosts.parts_on_host(ranks.rank), config.memory_log or 0,
                                   log_processes=len(hosts.host_of(ranks.rank)))
    except ConfigError as exc:
        error = exc
    if not ranks.agree_all(error is None):  # (a rank raising alone: the others would hang)
        raise error or ConfigError("the memory tier: another rank refused memory= (its error "
                                   "says why)")
    if not ranks.agree_all(limit is not None):
        return None
    return MemoryTier(config.directory, config.memory_dir, limit,
                      owner=ranks.rank == hosts.leader_of(ranks.rank), hosts=hosts)
