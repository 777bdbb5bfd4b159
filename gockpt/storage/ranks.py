"""Several ranks committing one checkpoint together.

Each rank writes its own part (a complete single-rank checkpoint directory ``rank-NNNNN``)
inside one shared temporary directory; the global ``manifest.json`` is written by rank 0 and
the directory renamed into place only when every rank's part is durable. A checkpoint missing
a rank is therefore never visible, let alone ``latest``.

Coordination uses two gloo process groups of gockpt's own, created when the Checkpointer is
built (on every rank, in the same order, as torch.distributed requires): one for the training
thread (agreeing on K), one for the persist thread (the commit vote), so that the two threads
never interleave collectives on one group, and neither touches the training's own groups.

Their lifetime is the Checkpointer's. :meth:`Ranks.close` destroys them, so that gloo's worker
threads are joined while the interpreter is whole (left to the interpreter's finalization, a
worker that frees a tensor then needs the GIL and ends the process in ``std::terminate``).
:meth:`Ranks.abandon` is the way out of a process leaving on an exception: every collective of
ours, waiting or to come, gives up at once (the other ranks may never join it: they may wait for
this rank in a training collective), and a group with a collective left pending is kept alive
until the process ends -- destroying it would join a worker blocked in that collective.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import threading
import time
import zlib
from typing import Callable, List, Optional

import torch

from ..core.errors import CheckpointFailedError, ConfigError, StorageError
from ..core.plan import Plan
from ..core.planning import mark_parallel
from . import peers
from .commit import check_step_name
from .format import TMP_PREFIX
from .schema import PartsManifest, part_name


class Abandoned(CheckpointFailedError):
    """A collective of gockpt's was given up: this process abandons its checkpoints."""


def _keep_forever(*objects) -> None:
    """Never free ``objects`` (a group with a collective left pending, its work and tensors):
    freed, the group would join a worker blocked in that collective, and a tensor freed last by
    that worker would need the GIL during the interpreter's finalization."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class Ranks:
    """This process's place among the ranks (a single process is rank 0 of 1)."""

    def __init__(self):
        self.rank, self.world_size = 0, 1
        self._train_group = self._persist_group = None
        self._abandoned = threading.Event()
        self._kept = False  # a group of ours was left with a collective pending
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._train_group = dist.new_group(backend="gloo")
            self._persist_group = dist.new_group(backend="gloo")

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def part_name(self) -> str:
        """This rank's part directory."""
        return part_name(self.rank)

    def agree_max(self, value: int) -> int:
        """The largest ``value`` over the ranks (training thread)."""
        if not self.several:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._run(torch.distributed.all_reduce, self._train_group, t,
                  op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def agree_all(self, ok: bool, timeout: Optional[float] = None) -> Optional[bool]:
        """Whether ``ok`` holds on every rank (training thread); None when some rank did not
        join within ``timeout`` seconds."""
        if not self.several:
            return ok
        t = torch.tensor([int(bool(ok))], dtype=torch.int64)
        if not self._run(torch.distributed.all_reduce, self._train_group, t, timeout=timeout,
                         op=torch.distributed.ReduceOp.MIN):
            return None
        return bool(t.item())

    def check_name(self, root: str, name: str) -> None:
        """:func:`.commit.check_step_name` decided on rank 0, which publishes the checkpoint,
        for every rank (training thread): ranks reading the directory at other instants, or
        through a shared file system's caches, could disagree, and a rank raising alone would
        leave the others waiting in the boundary's collectives."""
        refused = None
        if self.rank == 0:
            try:
                check_step_name(root, name)
            except ConfigError as e:
                refused = e
        if not self.agree_all(refused is None):
            raise refused or ConfigError(f"rank 0 refused the checkpoint name {name!r} (its "
                                         "error says why)")

    def hosts(self, host_id: int) -> peers.Hosts:
        """The ranks by host, from every rank's ``host_id`` (training thread)."""
        every = self._all_gather([host_id], self._train_group)
        return peers.Hosts.of([host for host, in every], self.rank)

    def share(self, plan: Plan, replicated, global_slices=None) -> Plan:
        """``plan`` with its slots marked (:func:`~gockpt.core.planning.mark_parallel`:
        ``Config.replicated`` / ``global_slices``, DTensors' placements) and, when ranks are
        replicas of some of it, narrowed to this rank's share of that (:meth:`Plan.take_share`):
        each of N replicas copies, replays and writes 1/N of what they hold alike, and all of
        its own. The replicas of each tensor must have planned the same replicated state
        (ConfigError on every rank otherwise: the shares would not fit together). Training
        thread, on every rank."""
        shared = mark_parallel(plan, replicated, global_slices)
        if not (self.several and shared):
            return plan
        # one signature per set of replicas (None: every rank), compared among its members
        mine = {}
        for key in plan.replica_sets():
            alike = set(plan.held_alike(key))
            text = repr([(s.name, tuple(s.local.shape), str(s.local.dtype), s.opt_index,
                          s.dims, s.global_slice) for si, s in enumerate(plan.slots)
                         if si in alike]
                        + [plan.block_elems, sum(b.slot in alike for b in plan.blocks)])
            mine[key] = zlib.crc32(text.encode())
        everyone = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, mine, group=self._train_group)
        agreed = all(everyone[r].get(key) == crc for key, crc in mine.items()
                     for r in (range(self.world_size) if key is None else key))
        if not self.agree_all(agreed):
            raise ConfigError(
                "the ranks do not plan the same replicated state (parameter names, shapes, "
                "dtypes or optimizer order, or block_bytes / overlap_steps differ between "
                "replicas, Config.replicated or the DTensors' replicate dimension): replicas "
                "split their state into shares only if it is one state cut alike; pass the "
                "same options on every rank, or replicated=False for per-rank state")
        plan.take_share(self.rank, self.world_size)
        # the ranks' own slots may differ: a K that every rank's blocks can fill
        plan.k_cap = -self.agree_max(-plan.k_cap)
        return plan

    def gather(self, value) -> Optional[List]:
        """``value`` of every rank, in rank order, on rank 0 (None elsewhere); persist
        thread, on every rank."""
        if not self.several:
            return [value]
        every = self._gather_bytes(pickle.dumps(value))
        return None if every is None else [pickle.loads(b) for b in every]

    def gather_if(self, changed: bool, value: Callable[[], object]) -> Optional[List]:
        """``value()`` of every rank, in rank order, on rank 0 when ``changed`` holds on some
        rank (one int all-reduce decides; then one gather), else None; persist thread, on
        every rank. What changes rarely (the global index: with a plan) is gathered rarely."""
        if self.several:  # on some rank: the max over the ranks
            changed = self._all_min(-int(bool(changed))) < 0
        return self.gather(value()) if changed else None

    def _all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self._run(torch.distributed.all_reduce, self._persist_group, t,
                  op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    def _gather_bytes(self, data: bytes) -> Optional[List[bytes]]:
        """``data`` of every rank, in rank order, on rank 0 (None elsewhere): the sizes to
        every rank, then the bytes, padded alike, to rank 0 (persist thread)."""
        dist, group = torch.distributed, self._persist_group
        mine = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._run(dist.all_gather, group, sizes, mine)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (a pickle)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)] \
            if self.rank == 0 else None
        self._run(dist.gather, group, padded, out, dst=0)
        if out is None:
            return None
        return [t[:int(n.item())].numpy().tobytes() for t, n in zip(out, sizes)]

    def _run(self, collective, group, *tensors, timeout: Optional[float] = None,
             **options) -> bool:
        """``collective(*tensors, group=group, **options)``, waited for (raising its error);
        True once done. Given up -- and kept pending with its group and tensors until the
        process ends (see the module's docstring) -- when this process abandons its
        checkpoints (:meth:`abandon`: Abandoned; not even started once abandoned), or after
        ``timeout`` seconds (False)."""
        if self._abandoned.is_set():
            raise self._abandoned_error()
        work = collective(*tensors, group=group, async_op=True, **options)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-4
        while not work.is_completed():
            if self._abandoned.wait(delay) or (deadline is not None
                                               and time.monotonic() > deadline):
                self._kept = True
                _keep_forever(group, work, *tensors)
                if self._abandoned.is_set():
                    raise self._abandoned_error()
                return False
            delay = min(2 * delay, 0.02)  # prompt for quick agreements, cheap for slow ones
        work.wait()
        return True

    def swap(self, sends: dict, sources) -> dict:
        """:func:`peers.swap` on the persist group (persist thread, every rank)."""
        return peers.swap(sends, sources, self.world_size,
                          lambda collective, *tensors, **options: self._run(
                              collective, self._persist_group, *tensors, **options))

    @staticmethod
    def _abandoned_error() -> Abandoned:
        return Abandoned("this process abandons its checkpoints (it is leaving): not waiting "
                         "for the other ranks")

    def abandon(self) -> None:
        """Any thread: every collective of ours, waiting or to come, raises Abandoned at
        once. Then :meth:`close`."""
        self._abandoned.set()

    def close(self) -> None:
        """Destroy our groups (joining their workers), unless one was left with a collective
        pending (:meth:`abandon`); on every rank, once no thread of ours uses them."""
        groups = [g for g in (self._train_group, self._persist_group) if g is not None]
        self._train_group = self._persist_group = None
        if self._kept or not (groups and torch.distributed.is_initialized()):
            return  # (not initialized any more: the last reference to them goes with ours)
        for group in groups:
            try:
                torch.distributed.destroy_process_group(group)
            except ValueError:  # destroyed already (destroy_process_group() of every group)
                pass

    def commit(self, root: str, name: str, write_part: Optional[Callable[[str], None]],
               top_manifest: PartsManifest, new_writer: Callable,
               hosts: Optional[peers.Hosts] = None,
               exchange: Optional[Callable[[Optional[str], bool], bool]] = None) -> str:
        """Commit one checkpoint of every rank (persist thread, called on every rank).

        ``new_writer(root, name)`` makes the storage writer of the top-level directory;
        ``write_part(dir)`` writes and commits this rank's part inside ``dir``; ``None`` means
        this rank's checkpoint already failed (it still votes, so that nobody waits forever).
        ``root`` is one directory that every rank sees, or, with ``hosts``, one per host (the
        memory tier's): each host's lowest rank makes and commits that host's, and
        ``exchange(dir or None, whether this rank's part was written)`` -- called on every
        rank, whatever happened -- adds the parts the host keeps for others (False: it could
        not). Returns the final path; raises StorageError on every rank if any rank failed.
        """
        leader = 0 if hosts is None else hosts.leader_of(self.rank)
        top, header = None, [0, 0, 0]
        if self.rank == leader:
            try:
                top = new_writer(root, name)
                pid, token = top.tmp_path.rsplit("-", 2)[-2:]
                header = [1, int(pid), int(token, 16)]
            except Exception:
                header = [0, 0, 0]
        ok, pid, token = self._all_gather(header)[leader]
        mine, err = 0, None
        shared = os.path.join(os.path.abspath(root), f"{TMP_PREFIX}{name}-{pid}-{token:08x}") \
            if ok else None
        if shared is not None and write_part is not None:
            try:
                write_part(shared)
                mine = 1
            except Exception as exc:  # voted below; the caller reports its own error
                err = exc
        if exchange is not None and not exchange(shared, bool(mine)) and mine:
            mine, err = 0, StorageError(f"checkpoint {name}: this rank's part did not reach "
                                        "its peer, or the parts kept here did not all arrive")
        everyone = self._all_min(mine)
        committed = 1
        if self.rank == leader:
            committed = 0
            if top is not None and everyone:
                try:
                    top.commit(top_manifest.to_json())
                    committed = 1
                except Exception:
                    committed = 0
            elif top is not None:
                top.abort()
        if self._all_min(committed):
            return os.path.join(os.path.abspath(root), name)
        if write_part is not None and mine == 0 and ok and err is not None:
            raise err
        raise StorageError(f"checkpoint {name} was not committed: "
                           + ("another rank failed to write its part" if mine or not ok
                              else "this rank's part failed"))

    def _all_gather(self, values: List[int], group=None) -> List[List[int]]:
        """``values`` (ints, as many on every rank) of every rank, in rank order, on
        ``group`` (default: the persist thread's)."""
        if not self.several:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._run(torch.distributed.all_gather, group or self._persist_group, every, mine)
        return [[int(v) for v in t.tolist()] for t in every]
