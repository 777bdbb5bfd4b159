"""The memory tier: a process's newest committed checkpoint also kept in host shared memory
(``Config.memory``), so that a process restarted on the same host after a crash loads it at
memory speed -- and only after it has been checked as a disk checkpoint is.

Where: ``<memory_dir>/gockpt-<16 hex digits of the run directory's path>``, a run directory of
its own (``step-*/``, ``latest``; the same format as on disk, written by the same writer: a
temporary directory renamed into place, the manifest with every chunk's crc32c and the live
digests at F), with the run directory's path in a file beside them (``run``): another run's
copies are never taken, whatever their name. The previous copy stays until the new one is
complete.

Nothing here may fail a checkpoint: a memory copy that cannot be written (no space) is a
warning, and the disk checkpoint stands. Nothing here may restore a damaged copy: a load takes
the memory copy only when it is a copy of the checkpoint the disk's ``latest`` names
(:func:`usable_copy`: never over a ``latest`` a user moved back) and checks
every byte as it reads it; a wrong one makes it say so and load the disk's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import warnings
import zlib
from typing import Optional

import torch

from ..core.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, StorageError
from ..core.protocols import Committed
from .commit import (apply_retention, list_checkpoints, publish, replace_file, resolve,
                     write_file)
from .format import MANIFEST_FILE, TMP_PREFIX
from .manifest_file import read_manifest, read_small_file
from . import peers
from .schema import part_name
from .writer import CheckpointWriter

log = logging.getLogger("gockpt")

DEFAULT_DIR = "/dev/shm"
"""Where the copies go unless ``Config.memory_dir`` / ``gockpt.load(memory_dir=)`` says."""

RUN_FILE = "run"
"""The file beside the copies naming the run directory they belong to."""

PEERS_DIR = "peers"
"""Beside the copies: a part a rank received from its peer at a load (``peers/rank-N/<name>``),
until its host's next copy."""

_RUN_MAX_BYTES = 1 << 16


def root_of(directory: str, memory_dir: Optional[str] = None) -> str:
    """The memory tier's run directory for the (resolved) run ``directory``."""
    tag = hashlib.sha256(os.fsencode(directory)).hexdigest()[:16]
    return os.path.join(memory_dir or DEFAULT_DIR, f"gockpt-{tag}")


def free_bytes(memory_dir: str) -> int:
    """Bytes a process may still write under ``memory_dir``."""
    st = os.statvfs(memory_dir)
    return st.f_bavail * st.f_frsize


def host_id() -> int:
    """This host, as a number the ranks compare (``GOCKPT_HOST`` names it instead of the
    host name: the tests declare ranks of one machine on several hosts)."""
    return zlib.crc32((os.environ.get("GOCKPT_HOST") or socket.gethostname()).encode())


def budget(memory, memory_dir: str, checkpoint_bytes: int, processes: int = 1,
           log_bytes: int = 0, log_processes: Optional[int] = None) -> Optional[int]:
    """The bytes the tier may use (``Config.memory``: ``"auto"`` or a number), checked against
    two copies of the checkpoints of ``processes`` processes of ``checkpoint_bytes`` each
    (the new one is written beside the previous; on several hosts a host also holds the parts
    it keeps for its peers), beside the step logs of ``log_bytes`` each (``Config.memory_log``)
    of the ``log_processes`` processes of this host (default ``processes``; a step log is
    never sent to a peer), and the space ``memory_dir`` has left: None,
    with a warning, when ``"auto"`` does not fit (the tier is off); ConfigError when a number
    is too small or does not fit (the user asked for it). Checked here, once, so that no copy
    ends in a full tmpfs."""
    need = 2 * checkpoint_bytes * processes + (1 << 20)  # (+ manifests, latest)
    logs = processes if log_processes is None else log_processes
    whose = "this process's checkpoint" if processes == 1 else \
        f"the {processes} ranks' checkpoints"
    try:
        free = free_bytes(memory_dir)
    except OSError as exc:
        raise ConfigError(f"memory_dir {memory_dir!r}: {exc.strerror or exc}") from exc
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    if memory == "auto":
        if free < need:
            warnings.warn(f"gockpt: the memory tier is off: {memory_dir!r} has {mib(free)} free, "
                          f"two copies of {whose} need {mib(need)} (a larger "
                          "tmpfs, e.g. docker's --shm-size, or memory_dir= another one)",
                          RuntimeWarning, stacklevel=3)
            return None
        _check_log_space(memory_dir, free, need, log_bytes, logs)
        return need + need // 4  # (room for a checkpoint that grows a little)
    if memory < need:
        raise ConfigError(f"memory={memory} bytes is less than two copies of {whose} need "
                          f"({need} bytes, {mib(need)}); give at least that, or memory='auto'")
    if free < need:
        raise ConfigError(f"memory_dir {memory_dir!r} has {mib(free)} free; two copies of "
                          f"{whose} need {mib(need)}")
    _check_log_space(memory_dir, free, memory, log_bytes, logs)
    return memory


def _check_log_space(memory_dir: str, free: int, copies: int, log_bytes: int,
                     processes: int) -> None:
    """ConfigError when the step logs (``log_bytes`` for each of ``processes``: every rank
    keeps its own) do not fit in ``memory_dir`` beside the copies' ``copies`` bytes."""
    logs = log_bytes * processes
    if logs and free < copies + logs:
        each = "" if processes == 1 else f" for each of the {processes} ranks, {logs} in all"
        raise ConfigError(f"memory_dir {memory_dir!r} has {free} bytes free: the copies need "
                          f"{copies} and the step log memory_log={log_bytes}{each}; give "
                          "memory_log less, or memory_dir= a larger tmpfs")


class MemoryTier:
    """The copies of one run directory's checkpoints in host shared memory, a
    :class:`~gockpt.core.protocols.Tier` (persist thread: :meth:`publish`, on every rank; the
    training thread: :meth:`finish` at ``close()``). Several ranks share one host's copies
    (``owner``: the host's lowest rank, which names the run and removes them); on several
    hosts (``hosts``) each host's copy also holds the parts of the ranks whose peer is on it
    (:mod:`.peers`). ``ranks``: the job's ranks (:class:`.ranks.Ranks`), None for one process."""

    def __init__(self, directory: str, memory_dir: str, limit: int, owner: bool = True,
                 hosts: Optional[peers.Hosts] = None, ranks=None):
        self.directory, self.limit, self.owner = directory, limit, owner
        self.hosts = hosts if hosts is not None and hosts.several else None
        self.ranks = ranks if ranks is not None and ranks.several else None
        self.root = root_of(directory, memory_dir)
        os.makedirs(self.root, exist_ok=True)
        run = os.path.join(self.root, RUN_FILE)
        if owner and _run_of(self.root) != directory:
            replace_file(run, lambda tmp: write_file(tmp, os.fsencode(directory)))

    def publish(self, committed: Committed) -> Optional[str]:
        """Keep the checkpoint the run directory has just committed (``committed.tensors``:
        this rank's host copy at F, as stored on disk) as the newest copy, then drop the older
        ones; its path, or None, with a warning, when it cannot be kept (the disk's stands).
        On several ranks a collective (:meth:`_publish_parts`)."""
        if self.ranks is not None:
            return self._publish_parts(committed)
        name, tensors = committed.name, committed.tensors
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if 2 * nbytes > self.limit:
            warnings.warn(f"gockpt: checkpoint {name} not kept in memory: two copies take "
                          f"{2 * nbytes} bytes, the memory tier has {self.limit}",
                          RuntimeWarning, stacklevel=2)
            return None
        try:
            path = write_in_memory(self.root, name, tensors, committed.manifest,
                                   update_latest=True)
        except Exception as exc:  # (the writer removed its temporary directory)
            warnings.warn(f"gockpt: checkpoint {name} not kept in memory ({self.root}): {exc}",
                          RuntimeWarning, stacklevel=2)
            return None
        apply_retention(self.root, 1)
        return path

    def _publish_parts(self, committed: Committed) -> Optional[str]:
        """:meth:`publish` of a checkpoint of several ranks, on every rank: each rank's part
        and the top manifest committed together as on disk (:meth:`Ranks.commit`), so that the
        loader reads it as it reads the disk's -- one copy per host, with the parts it keeps
        for its peers; None, with a warning on every rank, when some rank's part could not be
        written."""
        ranks, name = self.ranks, committed.name
        nbytes = sum(t.numel() * t.element_size() for t in committed.tensors.values())
        parts = ranks.world_size if self.hosts is None else \
            self.hosts.parts_on_host(ranks.rank)
        fits = 2 * nbytes * parts <= self.limit

        def write_part(shared: str) -> None:
            if not fits:
                raise StorageError(f"two copies of the parts this host holds take more than the "
                                   f"memory tier's {self.limit} bytes")
            write_in_memory(shared, ranks.part_name(), committed.tensors, committed.manifest,
                            update_latest=False)

        def exchange(shared: Optional[str], written: bool) -> bool:
            return peers.exchange_parts(ranks, self.hosts, name, shared, written)

        try:
            path = ranks.commit(self.root, name, write_part, committed.top,
                                lambda root, n: CheckpointWriter(root, n, direct=False),
                                hosts=self.hosts,
                                exchange=exchange if self.hosts is not None else None)
        except Exception as exc:  # (on every rank: the vote failed)
            warnings.warn(f"gockpt: checkpoint {name} not kept in memory ({self.root}): {exc}",
                          RuntimeWarning, stacklevel=2)
            return None
        if self.owner:
            apply_retention(self.root, 1)
            shutil.rmtree(os.path.join(self.root, PEERS_DIR), ignore_errors=True)
        return path

    def finish(self, end_of_training: bool) -> None:
        """``close()``: at the end of training remove every copy (the disk holds them; each
        host's lowest rank removes its host's); a process leaving on an exception keeps them
        for its restart."""
        if end_of_training and self.owner:
            remove(self.directory, os.path.dirname(self.root))

    def stop(self) -> None:
        """Nothing runs of its own (the persist thread writes the copies)."""


class MemoryReader:
    """Where a load finds a run's checkpoint in host memory, a
    :class:`~gockpt.core.protocols.TierReader`: :func:`usable_copy`, and on several ranks the
    parts a rank's host lost from its peer's memory (:func:`from_peers`, a collective)."""

    def __init__(self, memory_dir: Optional[str] = None, several: bool = False):
        self.memory_dir, self.several = memory_dir, several

    def newest(self, run: str, disk: Optional[str]) -> Optional[str]:
        copy = usable_copy(run, disk, self.memory_dir)
        if self.several:  # a host that lost its memory: the parts its peers keep
            copy = from_peers(run, disk, copy, self.memory_dir)
        return copy


def write_in_memory(root: str, name: str, tensors: dict, manifest: dict, *,
                    update_latest: bool) -> str:
    """Write and commit checkpoint ``name`` in ``root`` on a tmpfs (the writer's way: a
    temporary directory renamed into place, the manifest last; no O_DIRECT, which tmpfs
    refuses); its path."""
    writer = CheckpointWriter(root, name, direct=False)
    writer.write_tensors(tensors)
    return writer.commit(manifest, update_latest=update_latest)


def remove(directory: str, memory_dir: Optional[str] = None) -> bool:
    """Remove the memory copies of run ``directory`` (``gockpt clean``, ``close()``);
    whether there were any. Another run's are never touched (their ``run`` file differs)."""
    root = owned_root(directory, memory_dir)
    if root is None:
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True


def usable_copy(directory: str, disk: Optional[str],
                memory_dir: Optional[str] = None) -> Optional[str]:
    """The memory copy of run ``directory`` to load instead of ``disk`` (the checkpoint the
    disk's ``latest`` gives, None if it has none): the one the copies' ``latest`` names, when
    the copies are of this run, committed and of ``disk``'s step; None otherwise (with a
    warning when its manifest is damaged). A copy is written after its disk checkpoint
    commits, so one newer than ``disk`` means ``latest`` was moved back on purpose (or the disk
    checkpoint removed): the disk's choice stands. The load checks every byte of the copy, and
    loads ``disk`` instead when a byte is wrong (:func:`gockpt.load`)."""
    root = owned_root(directory, memory_dir)
    if disk is None or root is None or not list_checkpoints(root):
        return None
    try:
        path = resolve(root)
    except CheckpointNotFoundError:
        return None
    try:
        if read_manifest(path)["step"] != read_manifest(disk)["step"]:
            return None  # older (not kept in memory) or newer (latest moved back on disk)
    except (CorruptCheckpointError, KeyError, TypeError) as exc:
        warnings.warn(f"gockpt: the memory copy {path} is damaged ({exc}); loading from disk",
                      RuntimeWarning, stacklevel=3)
        return None
    return path


def from_peers(directory: str, disk: Optional[str], copy: Optional[str],
               memory_dir: Optional[str] = None) -> Optional[str]:
    """``copy`` (this rank's :func:`usable_copy`), or where this rank's host lacks a part it
    reads -- the host's memory lost -- a copy of the checkpoint ``disk`` made here from what
    the rank keeping its part on another host sent (``peers/rank-N/<name>`` beside the
    copies); None when neither. A collective on several ranks (one gather; two all-to-alls
    only where a part is missing); on one host, ``copy`` as it is. The copy made here is
    checked by the load as any copy is."""
    dist = torch.distributed
    rank = dist.get_rank()
    have = copy is not None and _holds(copy, _parts_read(copy, rank))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (host_id(), have))
    hosts = peers.Hosts.of([host for host, _ in every], rank)
    lacking = [r for r, (_, ok) in enumerate(every) if not ok]
    if not hosts.several or not lacking or disk is None:
        return copy
    sends = {r: _bundle(copy, r) for r in lacking if hosts.peer_of(r) == rank}
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        got = peers.swap(sends, [hosts.peer_of(rank)] if not have else [], len(every),
                         lambda collective, *tensors, **options: collective(
                             *tensors, group=group, **options))
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    if have:
        return copy
    data = got[hosts.peer_of(rank)]
    if data is None:
        log.warning("gockpt: rank %d's memory copy is missing and its peer (rank %d) keeps "
                    "none of %s", rank, hosts.peer_of(rank), os.path.basename(disk))
        return None
    try:
        name, files = peers.unpack(data)
        path = _write_received(directory, memory_dir, rank, name, files)
    except (ValueError, OSError) as exc:
        warnings.warn(f"gockpt: what rank {hosts.peer_of(rank)} sent of this rank's memory copy "
                      f"could not be kept ({exc}); loading from disk", RuntimeWarning,
                      stacklevel=3)
        return None
    log.info("gockpt: rank %d's part of %s came from the memory of rank %d (another host)",
             rank, name, hosts.peer_of(rank))
    return path


def _parts_read(copy: str, rank: int) -> list:
    """The parts of the copy ``copy`` that ``rank`` reads at a load: its own, or every rank's
    where the ranks wrote replicated state in shares."""
    try:
        top = read_manifest(copy)
    except (CorruptCheckpointError, OSError):
        return [part_name(rank)]
    return list(top.get("ranks", [])) if top.get("shares") else [part_name(rank)]


def _holds(copy: str, parts: list) -> bool:
    """Whether the copy ``copy`` has each of ``parts`` (its manifest: written last)."""
    return all(os.path.isfile(os.path.join(copy, p, MANIFEST_FILE)) for p in parts)


def _bundle(copy: Optional[str], rank: int):
    """The files of the copy ``copy`` that ``rank`` reads (its top-level files and the parts of
    :func:`_parts_read`) as one tensor to send; None when this host's copy lacks one."""
    if copy is None:
        return None
    needed = _parts_read(copy, rank)
    if not _holds(copy, needed):
        return None
    try:  # (a rank raising here alone would leave the others in the swap)
        files = {rel: path for rel, path in peers.part_files(copy).items()
                 if "/" not in rel or rel.split("/", 1)[0] in needed}
        return peers.pack(os.path.basename(copy), files)
    except OSError as exc:
        log.warning("gockpt: %s could not be read for rank %d: %s", copy, rank, exc)
        return None


def _write_received(directory: str, memory_dir: Optional[str], rank: int, name: str,
                    files: dict) -> str:
    """Keep what a peer sent of checkpoint ``name`` in this host's memory, as a committed copy
    of this run (a temporary directory renamed into place); its path."""
    root = root_of(directory, memory_dir)
    os.makedirs(root, exist_ok=True)
    run = _run_of(root)
    if run is None:  # (the host's copies were lost: named again)
        replace_file(os.path.join(root, RUN_FILE),
                     lambda tmp: write_file(tmp, os.fsencode(directory)))
    elif run != directory:
        raise OSError(f"{root} holds another run's copies")
    mine = os.path.join(root, PEERS_DIR, part_name(rank))
    shutil.rmtree(mine, ignore_errors=True)
    os.makedirs(mine)
    tmp = os.path.join(mine, f"{TMP_PREFIX}{name}-{os.getpid()}")
    peers.write_files(tmp, files)
    publish(mine, tmp, name)
    return os.path.join(mine, name)


def owned_root(directory: str, memory_dir: Optional[str] = None) -> Optional[str]:
    """The memory tier's run directory of run ``directory`` when it holds this run's copies
    (its ``run`` file names ``directory``), else None."""
    root = root_of(directory, memory_dir)
    return root if _run_of(root) == directory else None


def _run_of(root: str) -> Optional[str]:
    """The run directory the copies in ``root`` belong to (None: no such copies)."""
    try:
        return os.fsdecode(read_small_file(os.path.join(root, RUN_FILE), _RUN_MAX_BYTES, "run"))
    except OSError:
        return None
