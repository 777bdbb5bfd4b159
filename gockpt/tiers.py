"""The tiers side by side, and the one place that picks among them.

Every tier keeps a run's committed checkpoints in the one format (:mod:`gockpt.storage`), each
in its own module and behind the interfaces of :mod:`gockpt.core.protocols` (``Tier``: what
it publishes; ``TierReader``: what a load finds there), read by the one reader:

- the run directory, on local disk or in an object store by its ``s3://`` URL: the tier that
  commits (the persist thread's writer and commit); found by
  :class:`~.storage.disk_tier.DiskReader` (its ``latest``, or a tag);
- host memory (``Config.memory``): :class:`~.storage.memory_tier.MemoryTier`, each part also
  in a peer host's memory; found by :class:`~.storage.memory_tier.MemoryReader` (a copy of
  the run directory's newest; on several hosts, a part the host lost from its peer's);
- an object store (``Config.remote``): :class:`~.storage.remote_tier.RemoteTier`, rank 0
  uploading; found by its URL, as a run directory.

:class:`Tiers` is what a Checkpointer holds: the tiers beyond the run directory, made (agreed
by every rank), handed each committed checkpoint, finished at ``close()`` and stopped.
:func:`newest` is what ``gockpt.load`` reads: the memory copy where it may be loaded, else
the run directory's.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional

from .agree import everyone, several
from .core.config import Config
from .core.errors import ConfigError
from .core.latch import Latch
from .core.paths import is_remote
from .core.protocols import Committed, Tier
from .storage import memory_tier, remote
from .storage.commit import is_committed
from .storage.disk_tier import DiskReader
from .storage.memory_tier import MemoryReader, MemoryTier
from .storage.ranks import Ranks
from .storage.remote_tier import RemoteTier
from .storage.replicate import RemoteStatus


class Tiers:
    """The memory and remote tiers of one Checkpointer (built on every rank, together)."""

    def __init__(self, config: Config, ranks: Ranks, state_bytes: int,
                 copies_in_progress: Callable[[], Optional[Latch]]):
        """``state_bytes``: one checkpoint of this rank (the memory tier's space);
        ``copies_in_progress``: the event ending the current checkpoint's copies, which the
        uploads wait for (they never slow the copies down)."""
        self.memory: Optional[MemoryTier] = None
        if config.memory is not None:
            self.memory = _memory_tier(config, ranks, state_bytes)
        self.remote: Optional[RemoteTier] = None
        if config.remote is not None:
            remote.register(config.remote, config.remote_options)
            if ranks.rank == 0:  # (rank 0 uploads every rank's part)
                self.remote = RemoteTier(config.directory, config.remote,
                                         keep_last=config.remote_keep_last,
                                         retry_s=config.remote_retry_s,
                                         wait_s=config.remote_wait_s,
                                         yield_to=copies_in_progress)
        self.tiers: List[Tier] = [t for t in (self.memory, self.remote) if t is not None]

    def publish(self, committed: Committed) -> None:
        """The run directory committed ``committed`` (persist thread, every rank): every tier
        takes it, the memory tier first (a collective on several ranks)."""
        for tier in self.tiers:
            tier.publish(committed)

    def finish(self, end_of_training: bool) -> None:
        """``close()``: what every tier owes the job (:meth:`Tier.finish`), the uploads first
        (in the reverse order of :meth:`publish`); a tier that raises does not keep the others
        from finishing (the first error is raised after)."""
        error = None
        for tier in reversed(self.tiers):
            try:
                tier.finish(end_of_training)
            except Exception as exc:  # noqa: BLE001 -- raised below, once every tier is done
                error = error or exc
        if error is not None:
            raise error

    def stop(self) -> None:
        """Stop every tier now (the end of ``close()`` and ``abort()``)."""
        for tier in self.tiers:
            tier.stop()

    def wait_remote(self, timeout: Optional[float]) -> Optional[RemoteStatus]:
        """Wait until every committed checkpoint is in the store (at most ``timeout`` s)."""
        return None if self.remote is None else self.remote.wait(timeout)

    def remote_status(self) -> Optional[RemoteStatus]:
        return None if self.remote is None else self.remote.status()


def newest(path: str, tag: Optional[str], memory_dir: Optional[str], memory: bool) -> tuple:
    """(the run directory, the checkpoint to load, the run directory's own) for ``path`` and
    ``tag``: the memory tier's copy when ``memory`` and it may be loaded (on several ranks,
    when every rank's may: a collective; the load still checks every byte of it), else the
    run directory's."""
    run_directory = DiskReader(tag)
    if not memory or tag is not None or is_remote(path) or not os.path.isdir(path) \
            or is_committed(path):  # (one checkpoint's directory, or the store: that one)
        top = run_directory.find(path)
        return os.path.dirname(top), top, top
    disk = run_directory.newest(path)
    copy = MemoryReader(memory_dir, several()).newest(path, disk)  # (of the disk's step)
    if several() and not everyone(copy is not None):
        copy = None
    if copy is not None:
        return path, copy, disk
    disk = disk if disk is not None else run_directory.find(path)  # (raises: what is there)
    return path, disk, disk


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
                      owner=ranks.rank == hosts.leader_of(ranks.rank), hosts=hosts, ranks=ranks)
