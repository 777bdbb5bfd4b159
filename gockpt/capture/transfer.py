"""Copy engine: one priority queue of device-to-host copies.

Copies go by their deadline. Gradient copies go first: those that read ``.grad`` must land
before the loop's next backward overwrites it (the bf16 images, which need not, go with them).
State copies go next: the next ``update_begin`` waits for them. Gradient copies that read a
private snapshot (the CPU) go last: nothing waits for them but the snapshot's reuse two steps
later and the replay, so the state's copies of a window's last steps, which carry the most
gradients, are not queued behind them. On the CPU
the C++ engine (``_C.CopyEngine``, csrc/copy_engine.h) runs them on its own thread in pieces of
at most 1 MiB, re-choosing by priority after each piece, so a gradient submitted while a long
state transfer is running waits for at most one piece; a whole group of copies is one call.
On a GPU the copies are enqueued on side streams of different priorities and the thread is not
involved (``Ticket.event``).  Which of the two runs a group is the device's choice
(``Device.submit`` in :mod:`.device`); the engine only holds the host thread and the counts.
``link_gbps`` paces the host engine like a link of that many GB/s (1e9 bytes/s), to develop the
overlap on a CPU-only machine.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from gockpt import _C
from gockpt.core.arrays import int64_arrays

GRADIENT = 0  # priority classes: smaller runs first
STATE = 1
SNAPSHOT = 2  # gradients copied from a private snapshot (no deadline but its reuse)
PIECE_BYTES = 1 << 20  # the most a better priority waits for


class Ticket:
    """Completion of one submitted group of copies.

    Made by ``CopyEngine`` (``n_pairs``: how many copies it stands for, ``nbytes``: their
    bytes; ``engine``/``engine_id``: the host engine's ticket running them; ``event``: the
    event behind copies enqueued on an asynchronous device, with ``query()`` and
    ``synchronize()``: a CUDA event, or a simulated one); ``Ticket(0, 0)`` is a ticket with nothing to
    wait for.  While the host engine runs it, it holds the engine ticket and the objects whose
    memory the copies use (:meth:`keep`); the first ``done()``/``wait()`` that sees it complete
    takes its time and lets both go.
    """

    def __init__(self, n_pairs: int = 0, nbytes: int = 0, *, engine=None, engine_id: int = 0,
                 event=None, error: Optional[BaseException] = None):
        self.nbytes = nbytes
        self.error = error  # the group could not be queued (raised by wait())
        self.event = event
        self._engine = engine  # the _C.CopyEngine running it, until it is seen complete
        self._id = engine_id
        self._keep: list = []  # objects whose memory the pending copies read or write
        self._seconds = 0.0
        self._lock = threading.Lock()

    def keep(self, *objects) -> "Ticket":
        """Keep ``objects`` alive until the copies are done (memory they read or write)."""
        with self._lock:
            self._keep.extend(objects)
        return self

    @property
    def seconds(self) -> float:
        """Time the engine spent on this ticket (CPU: its copies, pacing included)."""
        with self._lock:
            if self._engine is not None:
                return self._engine.seconds(self._id)
            return self._seconds

    def _settle(self) -> bool:
        """Complete if the copies have landed: keep the time, forget the engine ticket, let the
        memory go, in one call that never waits and keeps the GIL (lock held). Whether it is
        complete."""
        if self._engine is None:
            return True
        seconds = self._engine.take_done(self._id)
        if seconds is None:
            return False
        self._seconds, self._engine, self._keep = seconds, None, []
        return True

    def done(self) -> bool:
        if self.event is not None:
            return self.event.query()
        with self._lock:
            return self._settle()

    def wait(self) -> None:
        """Block until every copy of this ticket has landed; raise a submission error."""
        if self.event is not None:
            self.event.synchronize()
        else:
            with self._lock:  # the usual case, copies landed: settled at once
                engine = None if self._settle() else self._engine
            if engine is not None:
                engine.wait(self._id)  # GIL released; a released id counts as done
                with self._lock:
                    self._settle()
        if self.error is not None:
            raise self.error

    def __del__(self):
        # Never let memory the engine still writes die first: release() waits for the copies.
        engine = getattr(self, "_engine", None)
        if engine is not None:
            try:
                engine.release(self._id)
            except Exception:  # interpreter shutdown
                pass


def _pair_error(i: int, d: torch.Tensor, s: torch.Tensor) -> str:
    if not (d.is_contiguous() and s.is_contiguous()):
        return f"copy {i}: dst and src must be contiguous"
    if d.dtype != s.dtype or not (d.is_cpu and s.is_cpu):
        return (f"copy {i}: dst ({d.dtype}, {d.device}) and src ({s.dtype}, {s.device}) must be "
                f"host tensors of one dtype")
    return f"copy {i}: size mismatch: dst has {d.numel()} elements, src {s.numel()}"


def _pair_arrays(pairs) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, src, nbytes) of (dst, src) tensor pairs; ValueError naming the first bad pair."""
    dst, src, nbytes = [], [], []
    for d, s in pairs:
        nb = s.nbytes
        if not (d.nbytes == nb and d.dtype == s.dtype and d.is_cpu and s.is_cpu
                and d.is_contiguous() and s.is_contiguous()):
            raise ValueError(_pair_error(len(dst), d, s))
        dst.append(d.data_ptr())
        src.append(s.data_ptr())
        nbytes.append(nb)
    return (np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64),
            np.array(nbytes, dtype=np.int64))


class TensorPairs:
    """Tensor pairs ``(dst, src)`` as a copy group (``device.CopyGroup``)."""

    def __init__(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]):
        self._pairs = pairs

    def pairs(self):
        return list(self._pairs)

    def segments(self):
        """Their addresses; ValueError naming the first pair that cannot be copied so."""
        return (*_pair_arrays(self._pairs), [self._pairs])


class CopyEngine:
    """Runs copies ``dst <- src`` by priority, off the training thread."""

    def __init__(self, device, link_gbps: Optional[float] = None):
        rate = 0.0 if link_gbps is None else float(link_gbps) * 1e9
        if link_gbps is not None and not 0 < rate < float("inf"):
            raise ValueError(f"link_gbps must be a positive number of GB/s, got {link_gbps!r}")
        self.device = device
        self._link_rate = rate
        self._engine = _C.CopyEngine(rate, PIECE_BYTES)
        self._async_bytes = 0  # bytes enqueued on CUDA streams

    @property
    def bytes_copied(self) -> int:
        return self._async_bytes + self._engine.stats()[0]

    @property
    def copy_seconds(self) -> float:
        """Host engine time spent copying (CUDA copies are not timed)."""
        return self._engine.stats()[1]

    def submit(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], priority: int) -> Ticket:
        """Queue copies; returns a ticket to wait on. ``pairs`` are (host dst, device src),
        contiguous, of one dtype and size; a pair that is not fails the ticket (at wait())."""
        return self.submit_group(TensorPairs(pairs), priority)

    def submit_group(self, group, priority: int) -> Ticket:
        """Queue a group of copies described both ways (``device.CopyGroup``): the device
        takes the form it runs."""
        return self.device.submit(self, group, priority)

    def note_enqueued(self, nbytes: int) -> None:
        """Count bytes a device enqueued on its own streams (not run by the host engine)."""
        self._async_bytes += nbytes

    def submit_segments(self, dst, src, nbytes, priority: int) -> Ticket:
        """Queue ``memcpy(dst[i], src[i], nbytes[i])`` for every i: host addresses as 1-D integer
        numpy arrays of one length.  The memory must stay valid until the ticket is done."""
        if not (_int64_vector(dst) and _int64_vector(src) and _int64_vector(nbytes)):
            dst, src, nbytes = int64_arrays(("dst", dst), ("src", src), ("nbytes", nbytes))
        return self.submit_own(dst, src, nbytes, priority)

    def submit_own(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray,
                   priority: int) -> Ticket:
        """:meth:`submit_segments` of arrays gockpt made itself, 1-D int64 C-contiguous ones
        (the hooks' own tables): queued without a check in Python -- lengths and negative
        sizes are the C++ submit's, in its own pass, which also counts the bytes (after a
        training step each numpy call on the hooks' path costs tens of microseconds)."""
        engine_id, total = self._engine.submit_counted(priority, dst, src, nbytes)
        return Ticket(len(dst), total, engine=self._engine, engine_id=engine_id)

    def bandwidth(self) -> float:
        """Measured copy bandwidth in bytes/s; before any copy, the emulated link's rate
        (0 when there is none: unknown)."""
        bytes_done, seconds = self._engine.stats()
        return (self._async_bytes + bytes_done) / seconds if seconds > 0 else self._link_rate

    def close(self) -> None:
        """Finish queued copies and stop the transfer thread (and the device's own)."""
        self._engine.close()
        self.device.close()


def _int64_vector(a) -> bool:
    """Whether ``a`` is already what the C++ core takes: a 1-D C-contiguous int64 array (the
    hooks' own tables: passed on without a check per array)."""
    return type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 and \
        a.flags.c_contiguous
