"""The memory tier across hosts: each rank's part of a checkpoint also kept in the memory of a
rank on another host (its peer), so that a restart on a host whose memory was lost (the host
replaced, its ``/dev/shm`` cleared) takes its part from the peer's host, not from the disk.

Whose peer is whom (:class:`Hosts`): the hosts ordered by their lowest rank, each rank's peer
the rank at the same place on the next host (the last host's: the first's). A host's copy of
a checkpoint therefore holds its own ranks' parts and those it keeps for the previous host's
ranks (written by :meth:`MemoryTier.publish`, one committed directory per host).

What crosses between ranks: a checkpoint's files as one byte tensor each way (:func:`pack`,
:func:`unpack`: a JSON list of the files' relative paths and sizes, then their bytes), moved
by two all-to-alls on a gloo group (:func:`swap`). Nothing sent is trusted: the receiver writes
the files as they came, and the load checks every byte of them against the part's own
manifest (crc32c per chunk) and the digests of the live state at F, as for any copy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .schema import part_name

_LENGTH = 8  # the header's length, before it: little-endian uint64


@dataclass(frozen=True)
class Hosts:
    """The ranks of a job by host (``hosts``: each host's ranks in order, the hosts ordered by
    their lowest rank) and where ``rank`` lies among them."""

    hosts: Tuple[Tuple[int, ...], ...]
    rank: int

    @classmethod
    def of(cls, host_ids: Sequence[int], rank: int) -> "Hosts":
        """From every rank's host id (:func:`memory_tier.host_id`), in rank order."""
        by_host: Dict[int, List[int]] = {}
        for r, host in enumerate(host_ids):
            by_host.setdefault(host, []).append(r)
        return cls(tuple(tuple(ranks) for ranks in sorted(by_host.values())), rank)

    @property
    def several(self) -> bool:
        return len(self.hosts) > 1

    @cached_property
    def _host(self) -> Dict[int, int]:
        """rank -> the index of its host (worked out once: asked at every checkpoint)."""
        return {r: h for h, ranks in enumerate(self.hosts) for r in ranks}

    @cached_property
    def _peer(self) -> Dict[int, int]:
        """rank -> its peer: the rank at its place on the next host (none on one host)."""
        if not self.several:
            return {}
        return {r: there[i % len(there)]
                for here, there in zip(self.hosts, self.hosts[1:] + self.hosts[:1])
                for i, r in enumerate(here)}

    @cached_property
    def _kept(self) -> Dict[int, List[int]]:
        """rank -> the ranks whose parts it keeps, in rank order."""
        kept: Dict[int, List[int]] = {}
        for r, peer in sorted(self._peer.items()):
            kept.setdefault(peer, []).append(r)
        return kept

    def leader_of(self, r: int) -> int:
        """The lowest rank on ``r``'s host: it makes, commits and removes that host's copies."""
        return self.host_of(r)[0]

    def peer_of(self, r: int) -> Optional[int]:
        """The rank on the next host that keeps ``r``'s part (None: one host)."""
        return self._peer.get(r)

    def kept_by(self, r: int) -> List[int]:
        """The ranks whose parts ``r`` keeps (those whose peer it is)."""
        return list(self._kept.get(r, []))

    def host_of(self, r: int) -> Tuple[int, ...]:
        """The ranks on ``r``'s host, ``r`` among them."""
        return self.hosts[self._host[r]]

    def parts_on_host(self, r: int) -> int:
        """How many ranks' parts ``r``'s host holds: its own ranks' and those its ranks keep."""
        here = self.host_of(r)
        return len(here) + sum(len(self._kept.get(s, [])) for s in here)


def part_files(root: str, rel: str = "") -> Dict[str, str]:
    """The regular files under ``root`` (or its subdirectory ``rel``): relative path -> path."""
    out = {}
    base = os.path.join(root, rel) if rel else root
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        key = f"{rel}/{name}" if rel else name
        if os.path.isdir(path):
            out.update(part_files(root, key))
        elif os.path.isfile(path):
            out[key] = path
    return out


def pack(name: str, files: Dict[str, str]) -> torch.Tensor:
    """``files`` (relative path -> path) of checkpoint ``name`` as one uint8 tensor."""
    sizes = [[rel, os.path.getsize(path)] for rel, path in files.items()]
    header = json.dumps({"name": name, "files": sizes}).encode()
    out = torch.empty(_LENGTH + len(header) + sum(n for _, n in sizes), dtype=torch.uint8)
    buf = out.numpy()
    buf[:_LENGTH] = np.frombuffer(len(header).to_bytes(_LENGTH, "little"), dtype=np.uint8)
    buf[_LENGTH:_LENGTH + len(header)] = np.frombuffer(header, dtype=np.uint8)
    at = _LENGTH + len(header)
    for (rel, n), path in zip(sizes, files.values()):
        with open(path, "rb") as f:
            if f.readinto(memoryview(buf[at:at + n])) != n:
                raise OSError(f"{path} changed while it was read")
        at += n
    return out


def unpack(data: torch.Tensor) -> Tuple[str, Dict[str, memoryview]]:
    """(checkpoint name, relative path -> bytes) of a :func:`pack`; ValueError when it is not
    one (a path leaving the directory included)."""
    buf = data.numpy()
    if len(buf) < _LENGTH:
        raise ValueError("a bundle shorter than its header's length")
    length = int.from_bytes(buf[:_LENGTH].tobytes(), "little")
    try:  # (a header of another shape: ValueError, as a bad entry is -- never a KeyError
        # on one rank alone, which would leave the others in a collective)
        header = json.loads(buf[_LENGTH:_LENGTH + length].tobytes())
        name, entries = str(header["name"]), [(str(rel), int(n)) for rel, n in header["files"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a bundle whose header is not one ({exc})") from exc
    at, files = _LENGTH + length, {}
    for rel, n in entries:
        parts = rel.split("/")
        if not parts or any(p in ("", ".", "..") for p in parts) or n < 0 \
                or at + n > len(buf):
            raise ValueError(f"a bundle with a bad entry {rel!r}")
        files[rel] = memoryview(buf[at:at + n])
        at += n
    return name, files


def write_files(into: str, files: Dict[str, memoryview]) -> None:
    """Create ``into`` (it must not exist) holding ``files`` (relative path -> bytes)."""
    os.makedirs(into)
    for rel, data in files.items():
        path = os.path.join(into, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:
            f.write(data)


def swap(sends: Dict[int, Optional[torch.Tensor]], sources: Sequence[int], world: int,
         run: Callable) -> Dict[int, Optional[torch.Tensor]]:
    """Each tensor of ``sends`` (rank -> uint8 tensor, None: nothing to give) to its rank, and
    what each of ``sources`` sends here (None where it had nothing), among ``world`` ranks that
    all call it: two all-to-alls (the sizes, then the bytes), each run by
    ``run(collective, *tensors, **options)`` on a gloo group of every rank (the persist
    thread's gives up when the process abandons its checkpoints). Collectives, not point to
    point: a gloo send's completion shows only to a blocking wait."""
    dist = torch.distributed
    sizes = torch.full((world,), -1, dtype=torch.int64)  # -1: nothing to give
    for dst, data in sends.items():
        if data is not None:
            sizes[dst] = data.numel()
    came = torch.empty(world, dtype=torch.int64)
    run(dist.all_to_all_single, came, sizes)
    send_n = [max(n, 0) for n in sizes.tolist()]
    recv_n = [max(n, 0) for n in came.tolist()]
    empty = torch.empty(0, dtype=torch.uint8)
    data = torch.cat([sends[r] if send_n[r] else empty for r in range(world)])
    out = torch.empty(sum(recv_n), dtype=torch.uint8)
    run(dist.all_to_all_single, out, data, output_split_sizes=recv_n, input_split_sizes=send_n)
    pieces = out.split(recv_n)
    return {src: None if came[src] < 0 else pieces[src] for src in sources}


def exchange_parts(ranks, hosts: Hosts, name: str, shared: Optional[str], written: bool) -> bool:
    """At a memory copy's commit (on every rank, whatever happened): this rank's part of
    checkpoint ``name`` (written into ``shared`` if ``written``) sent to its peer on the next
    host, and the parts this host keeps for others written beside it; False when any of that
    failed (the commit's vote then fails)."""
    me, mine = ranks.rank, None
    if written:
        try:  # (a rank raising here alone would leave the others in the swap)
            mine = pack(name, part_files(os.path.join(shared, ranks.part_name())))
        except OSError:
            written = False
    got = ranks.swap({hosts.peer_of(me): mine}, hosts.kept_by(me))
    ok = shared is not None and written
    for src, data in got.items():
        if data is None or shared is None:  # (its part failed: the vote fails)
            ok = False
            continue
        try:
            write_files(os.path.join(shared, part_name(src)), unpack(data)[1])
        except (ValueError, OSError):
            ok = False
    return ok
