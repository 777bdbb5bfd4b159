"""Digests of whole tensors, computed on the device that holds them: on the CPU by gockpt's C++
core (``csrc/digest.cpp``, on threads of gockpt's own pool), on a GPU by torch ops.

The live training tensors at F (as the framework presents them: the tensor objects the model
and optimizer hold, not the addresses the copies use), their staged host copies, and the tensors read back at load time are digested by
the same function, so that a checkpoint is checked end to end against what training had --
independently of the copy path (its addresses, its queues, its kernels): a copy that read the
wrong memory, or wrote the right bytes to the wrong place, shows as a mismatch.

A tensor's elements, in logical (row-major) order whatever its memory layout -- so that a
layout recorded wrong (a transposed view) shows too; a copy only for a tensor that is not
contiguous -- are read as words of its element size (signed integers, sign-extended) and,
with rows of ``ROW`` words and ``r_j`` the sum of row ``j`` (the last one may be short):

    a = sum_j r_j                  (mod 2**64)
    b = sum_j r_j * (2*j + 1)      (mod 2**64)

Any single changed word changes ``a`` (the difference is not 0 mod 2**64); ``b`` weighs each
row by an odd, hence invertible, factor, so a block of bytes moved to another row, zeros where
data should be, or two compensating changes in different rows show in ``b``. Both are integer
sums: exact whatever the reduction order of a device (a GPU and the CPU give the same digest),
and one pass over memory. A digest is stored as 32 hex digits (``a`` then ``b``).

Many tensors are digested in one call (:func:`digests`): on the CPU one C++ call for all of
them; on a GPU a few batched ops -- the rows of the large ones summed per tensor, the small ones
(and the short last rows) concatenated and added per tensor with ``index_add_`` -- so that a
model of thousands of small tensors costs a few operations per tensor, not a dozen.
"""

from __future__ import annotations

import functools
import queue
import re
import threading
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _C

ROW = 256  # words per row
assert ROW == _C.DIGEST_ROW, "csrc/digest.h's row must be this one"

_MASK = (1 << 64) - 1
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in element (row-major) order, as a 1-D tensor of signed words of its
    element size: a view of a contiguous tensor, a copy of another."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise TypeError(f"a digest is taken of a dense tensor, got {type(t).__name__}")
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_WORDS[flat.element_size()])


def digests(tensors: Sequence[torch.Tensor], threads: int = 0) -> torch.Tensor:
    """The digests of ``tensors`` (all on one device) as an (n, 2) int64 tensor on that device,
    row i being (a, b) of ``tensors[i]`` in its element order.

    On the CPU they are computed by gockpt's C++ core (``threads`` of gockpt's own pool, 0:
    every core), one pass over memory, never with torch ops: torch ops on a background thread
    share torch's intra-op threads with the training step and stall it far beyond their own
    work. On a GPU the ops are queued on the current stream (nothing is synchronised)."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    ws = [words(t) for t in tensors]
    device = ws[0].device
    if device.type == "cpu":
        return _cpu_digests(ws, threads)
    layout = _layout(tuple((w.numel(), w.dtype) for w in ws), device)
    a = torch.zeros(len(ws), dtype=torch.int64, device=device)
    b = torch.zeros(len(ws), dtype=torch.int64, device=device)
    if layout.large:
        rows = torch.cat([ws[i][:f].view(-1, ROW).sum(1, dtype=torch.int64)
                          for i, f in layout.large])
        a.index_add_(0, layout.row_owner, rows)
        b.index_add_(0, layout.row_owner, rows * layout.row_weight)
    for dtype, pieces in layout.short.items():  # the small tensors and the last short rows
        flat = torch.cat([ws[i][f:] for i, f in pieces]).to(torch.int64)
        sums = torch.zeros(len(ws), dtype=torch.int64, device=device)
        sums.index_add_(0, layout.short_owner[dtype], flat)
        a += sums
        b += sums * layout.short_weight
    return torch.stack([a, b], dim=1)


def _cpu_digests(ws: List[torch.Tensor], threads: int) -> torch.Tensor:
    """:func:`digests` of 1-D contiguous CPU words, by gockpt._C (``ws`` keeps them alive
    for the call)."""
    n = len(ws)
    addr = np.fromiter((w.data_ptr() for w in ws), dtype=np.int64, count=n)
    count = np.fromiter((w.numel() for w in ws), dtype=np.int64, count=n)
    size = np.fromiter((w.element_size() for w in ws), dtype=np.int64, count=n)
    return torch.from_numpy(_C.digests(addr, count, size, int(threads)))


def digest(t: torch.Tensor) -> Tuple[int, int]:
    """(a, b) of one tensor, as unsigned Python ints (synchronises)."""
    return as_pairs(digests([t]))[0]


def as_pairs(d: torch.Tensor) -> List[Tuple[int, int]]:
    """Rows of :func:`digests` as unsigned (a, b) Python ints (copied to the host)."""
    return [(int(x) & _MASK, int(y) & _MASK) for x, y in d.cpu().tolist()]


def to_hex(pair: Tuple[int, int]) -> str:
    """The manifest's spelling of a digest."""
    return f"{pair[0]:016x}{pair[1]:016x}"


_HEX = re.compile(r"[0-9a-f]{32}")


def is_hex(x) -> bool:
    """Whether ``x`` is a digest as the manifest spells it (one regular expression: a
    manifest holds a digest per tensor, each checked at every read)."""
    return isinstance(x, str) and _HEX.fullmatch(x) is not None


class _Layout:
    """How the words of tensors of given sizes split into full rows and short pieces, and
    whose each row and each short word is (index tensors on the device, built once per list
    of sizes: a checkpoint digests the same tensors every time)."""

    def __init__(self, sizes, device):
        self.large: List[Tuple[int, int]] = []   # (tensor, words in full rows)
        short: dict = {}                          # word dtype -> [(tensor, first short word)]
        owners, weights, short_owner = [], [], {}
        short_weight = np.ones(len(sizes), dtype=np.int64)
        for i, (n, dtype) in enumerate(sizes):
            full = n // ROW * ROW
            if full:
                self.large.append((i, full))
                owners.append(np.full(full // ROW, i, dtype=np.int64))
                weights.append(np.arange(1, 2 * (full // ROW), 2, dtype=np.int64))
                short_weight[i] = 2 * (full // ROW) + 1
            if n > full:
                short.setdefault(dtype, []).append((i, full))
                short_owner.setdefault(dtype, []).append(np.full(n - full, i, dtype=np.int64))
        self.short = short

        def on_device(parts):
            return torch.from_numpy(np.concatenate(parts)).to(device)

        if self.large:
            self.row_owner, self.row_weight = on_device(owners), on_device(weights)
        self.short_owner = {d: on_device(p) for d, p in short_owner.items()}
        self.short_weight = torch.from_numpy(short_weight).to(device)


@functools.lru_cache(maxsize=16)
def _layout(sizes: tuple, device: torch.device) -> _Layout:
    return _Layout(sizes, device)


# ---------------------------------------------------------------------------- live digests

class Ticket:
    """The digests of some live tensors, on their way.

    ``reads_done`` is set once the digests no longer read the live tensors (CPU: computed;
    GPU: queued on the side stream, ``done_event`` recorded behind them)."""

    def __init__(self, n: int):
        self.n = n
        self.reads_done = threading.Event()
        self.done_event = None  # a CUDA event behind the digests' reads (GPU)
        self.result: Optional[torch.Tensor] = None
        self.error: Optional[BaseException] = None
        self.seconds = 0.0

    def pairs(self) -> List[Tuple[int, int]]:
        """The digests as unsigned pairs (waits for them); re-raises a failure."""
        self.reads_done.wait()
        if self.error is not None:
            raise self.error
        if self.done_event is not None:
            # (GPU) computed on the side stream: the copy to the host below runs on this
            # thread's stream, which nothing orders after it
            self.done_event.synchronize()
        return as_pairs(self.result)


class LiveDigests:
    """One background thread ("gockpt-digest") that digests live training tensors behind the
    work queued so far, so that the training thread pays only for queueing them: on the CPU it
    computes them (while the loop runs the next forward/backward) on ``threads`` of gockpt's
    pool -- one by default: the training step has the cores --; on a GPU it queues the ops on
    a side stream of the device (``device.behind``) and the next update waits for them there
    (``device.order_after_digests``)."""

    def __init__(self, device, threads: int = 1):
        self.device, self.threads = device, threads
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()  # (C-level put: a hook queues)
        self._thread = threading.Thread(target=self._run, name="gockpt-digest", daemon=True)
        self._thread.start()

    def submit(self, tensors: List[torch.Tensor]) -> Ticket:
        """Digest ``tensors`` (memory-order views of live tensors) as they are now."""
        ticket = Ticket(len(tensors))
        self._queue.put((tensors, self.device.mark(), ticket))
        return ticket

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensors, mark, ticket = item
            t0 = time.perf_counter()
            try:
                with self.device.behind(mark) as done:
                    ticket.result = digests(tensors, self.threads)
                ticket.done_event = done.get("event")
            except BaseException as exc:  # surfaced by Ticket.pairs()
                ticket.error = exc
            ticket.seconds = time.perf_counter() - t0
            ticket.reads_done.set()
