"""Where the live tensors a copy reads are, and whether something wrote them meanwhile.

Per role (None: the parameter, else an optimizer state key) and per slot, the address of the
live tensor in the parameter's planned memory order, read with one C++ pass per list
(:mod:`gockpt._tensors`, not a Python step per tensor); the tensors read are kept with their
version counters, so that an in-place write outside the optimizer during the copy is found when
it lands.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from .. import _tensors
from ..core.blocks import BlockTable
from ..core.lists import has_none
from ..core.errors import LayoutChangedError
from ..core.memory import flat, local
from ..core.plan import Plan
from ..core.planning import check_layouts
from ..core.staging import HostCopy


def live_bases(plan: Plan, states: list, slots: np.ndarray, key, keep: list
               ) -> Tuple[np.ndarray, tuple]:
    """For role ``key`` (None: the parameter, else an optimizer state key; ``states``: each
    slot's state dict, None where none yet) of each slot of ``slots`` (an int64 array): the
    address of the live tensor in its parameter's planned memory order (0 where it has no
    such state yet), and the tensors read as a :class:`Reads` column. Tensors laid out unlike
    their parameter are read through flat copies, appended to ``keep`` (alive until the copy
    has run)."""
    if not plan.dtensors:  # the usual case: one C++ pass, for every slot at once
        tensors, *scan, every = _tensors.gather_scan(
            plan.params if key is None else states, slots, key)
        if plan.contiguous and every & _tensors.CONTIGUOUS:
            return scan[0], (slots, tensors, scan)
    sis = slots.tolist()
    if key is None:
        params = plan.locals()  # (read anew for DTensors: once, not per slot)
        tensors = [params[si] for si in sis]
    else:
        tensors = _tensors.values([states[si] for si in sis], key)
        if plan.dtensors:  # their local shards
            tensors = [None if t is None else local(t) for t in tensors]
    have = sis
    present = tensors
    if has_none(tensors):  # no such state yet
        have = [si for si, t in zip(sis, tensors) if t is not None]
        present = [t for t in tensors if t is not None]
    scan = _tensors.scan(tensors)  # (addresses, versions, flags): each tensor read once
    ordered = in_memory_order(plan, have, present, keep, scan[2][scan[2] != 0])
    if ordered is present:
        return scan[0], (slots, tensors, scan)
    at = dict(zip(have, data_ptrs(ordered).tolist()))  # (the flat copies': what is copied)
    return np.fromiter((at.get(si, 0) for si in sis), np.int64, len(sis)), (slots, tensors, scan)


def group_sources(plan: Plan, states: list, roles: list, lookup=None
                  ) -> Optional[Tuple[np.ndarray, list, int]]:
    """What :func:`live_bases` finds for each role of a group's copies, and the sources of the
    copies' rows, every role in one C++ pass (:func:`gockpt._tensors.segment_sources`):
    ``roles`` are the group's roles (``key``, ``slots``, and per row copied ``at``: its slot's
    place among them, ``offset``: the bytes from the tensor's start). Returns (per row, its
    source address, 0 where the tensor is absent: no such state yet; the tensors read, as
    :class:`Reads` columns; how many rows are absent), or None where :func:`live_bases` must
    read role by role: DTensors, or a tensor laid out unlike its parameter. The parameters
    read are checked against their planned strides in the same pass (LayoutChangedError:
    :func:`gockpt.core.planning.check_layouts`, which a checkpoint's start then leaves to
    these copies). ``lookup``: key -> the :class:`gockpt._tensors.DictValues` reading that
    key of ``states`` (the state dicts not changed since are not looked up again), or None:
    every dict looked up."""
    if plan.dtensors or not plan.contiguous:
        return None
    src, scans, every, absent, as_planned = _tensors.segment_sources(
        [(plan.params, role.slots, None, role.at, role.offset, plan.strides) if role.key is None
         else (states, role.slots, role.key if lookup is None else lookup(role.key), role.at,
               role.offset) for role in roles], 0)
    if not as_planned:  # a parameter's strides changed (read in the same pass)
        check_layouts(plan)  # (raises LayoutChangedError naming it)
        raise LayoutChangedError("a parameter changed its memory layout after the "
                                 "Checkpointer was built")
    if not every & _tensors.CONTIGUOUS:
        return None
    return src, [(role.slots, tensors, (at, versions, flags))
                 for role, (tensors, at, versions, flags) in zip(roles, scans)], absent


def data_ptrs(tensors: list) -> np.ndarray:
    """The address of each of ``tensors``, as an int64 array (one C++ pass)."""
    return _tensors.addresses(tensors)


def in_memory_order(plan: Plan, slots: list, tensors: list, keep: list,
                    flags: np.ndarray) -> list:
    """``tensors`` (one per slot of ``slots``) each laid out as its parameter was planned: the
    tensor itself, or (rare: a state tensor or gradient with other strides) a flat copy in the
    parameter's memory order, also appended to ``keep`` (alive until its copy has run).
    ``flags``: the tensors' :func:`gockpt._tensors.scan` flags."""
    if plan.contiguous and np.all(flags & _tensors.CONTIGUOUS):
        return tensors  # the usual case, found without reading every tensor's strides
    planned = plan.strides
    if [t.stride() for t in tensors] == [planned[si] for si in slots]:
        return tensors
    out = list(tensors)
    for i, si in enumerate(slots):
        if out[i].stride() != planned[si]:
            out[i] = flat(out[i], plan.slots[si].dims)
            keep.append(out[i])
    return out


class Reads:
    """The live tensors some queued copies (or digests) read, role by role as
    ``columns = [(slot indices, tensors[, their scan when queued]), ...]``, with their
    versions and addresses when queued (:func:`gockpt._tensors.scan`, read here where not
    given): an in-place write since then (outside the optimizer), or a tensor moved to other
    memory (``p.data = ...``, which leaves its version as it was), is found by
    :meth:`written`."""

    def __init__(self, columns: list):
        self.columns = [(slots, tensors) for slots, tensors, *_ in columns]
        self.scans = [scan[0] if scan else _tensors.scan(tensors)
                      for _, tensors, *scan in columns]

    def written(self) -> set:
        """The slots of the tensors written or moved since they were queued (every column
        in one C++ call)."""
        return set(_tensors.moved_labels([(slots, tensors, at, version) for (slots, tensors),
                                          (at, version, _) in zip(self.columns, self.scans)]))


class Zeros:
    """Zero bytes to copy from where the optimizer has no state yet (grown as needed)."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None

    def address(self, nbytes: int) -> int:
        """Address of at least ``nbytes`` zero bytes (keep :attr:`buffer` alive with the copy:
        a larger one may replace it before the copy lands)."""
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.zeros(max(nbytes, 1 << 16), dtype=torch.uint8)
        return self.buffer.data_ptr()


#: No segments: (dst, src, nbytes) empty.
NO_SEGMENTS = (np.zeros(0, np.int64),) * 3


class Role:
    """The copies of one role (None: the parameter, else an aligned state key) of a table's
    blocks: the slots read, and per block row copied: its slot's place among them, the
    byte offset of its first element in the slot, and its bytes."""

    def __init__(self, key, slots: np.ndarray, at: np.ndarray, offset: np.ndarray,
                 nbytes: np.ndarray):
        self.key, self.slots, self.at, self.offset, self.nbytes = key, slots, at, offset, nbytes


class SegmentLayout:
    """What the memcpy segments of a table's blocks are, but for the live addresses: per role,
    a :class:`Role`; and every segment's destination in the host copy and its bytes, role
    after role (the sources are read at each copy: ``Capture.segments_of``)."""

    def __init__(self, host: HostCopy, table: BlockTable, params: BlockTable, roles):
        self.roles: List[Role] = []
        dst, size = [], []
        for key in roles:
            hbase, hitem = host.bases(key)
            t = params if key is None else table
            rows = hbase[t.slot] != 0  # the blocks whose slot has this role
            if not rows.any():
                continue
            sub = t.slot[rows]
            slots = np.unique(sub)
            offset = t.start[rows] * hitem[sub]
            nbytes = t.numel[rows] * hitem[sub]
            self.roles.append(Role(key, slots, np.searchsorted(slots, sub), offset, nbytes))
            dst.append(hbase[sub] + offset)
            size.append(nbytes)
        self.dst = np.concatenate(dst) if dst else NO_SEGMENTS[0]
        self.nbytes = np.concatenate(size) if size else NO_SEGMENTS[0]


__all__: List[str] = ["live_bases", "group_sources", "data_ptrs", "in_memory_order", "Reads",
                      "Zeros", "Role", "SegmentLayout", "NO_SEGMENTS"]
