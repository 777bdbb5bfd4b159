"""A simulated asynchronous device: CPU tensors that behave like the CUDA device.

The CUDA path (copies enqueued on side streams, completion by events, the compute stream
ordered by stream waits) cannot run on a machine without a GPU, and a GPU rarely shows an
ordering bug: its copies are fast and usually land before anything reads or overwrites them.
:class:`SimulatedAsyncDevice` runs that same path -- it shares every method the stages call
with :class:`~gockpt.capture.device.CudaDevice` (:class:`~gockpt.capture.device.AsyncDevice`)
-- on CPU tensors, with the hazards of a GPU made certain:

* copies are *enqueued* on one of two streams (gradients, state) and run later, in stream
  order, on the device's worker thread ("gockpt-simdev"); each enqueue returns a
  :class:`SimEvent` (``query()``, ``synchronize()``) behind that stream's copies so far;
* a host destination is valid only after its event: it is filled with 0xFF bytes (NaN in
  floating point) at enqueue, so that reading it early gives wrong bytes;
* a source is read when its copy runs: a source written before then gives wrong bytes;
* a source is kept alive until its copy ran (``record_stream``);
* "the compute stream waits for an event" (:meth:`SimulatedAsyncDevice.wait_event`): CPU
  work cannot be queued behind a copy, so the calling (training) thread has the copies up to
  that event run and waits for them -- the same ordering guarantee.

Two settings:

``eager``
    the worker runs every copy as soon as it can, gradients before state (it re-chooses
    after each copy, so a gradient copy overtakes a long state group, like the priority
    streams): the timing of a fast GPU.
``adversarial``
    copies run as late as allowed -- only when something forces them: their event
    synchronized (a ticket waited for), a stream wait on it (``order_after``), or ``close``.
    Nothing depends on timing where only the training thread waits for a copy (the state
    groups, the copies at F): every run makes them at the same points of the training loop,
    so a missing ordering shows as wrong bytes (poison, or a later version) every time. A
    wait from another thread forces too (the replay thread waiting for a step's gradients:
    a wait cannot return before its copies ran), so when those run against the training
    thread depends on scheduling; their ordering is tested on the device directly.

Selecting it without code changes: with ``GOCKPT_SIMULATED_DEVICE=eager`` or
``GOCKPT_SIMULATED_DEVICE=adversarial`` in the environment, ``device_for`` gives every
Checkpointer training on the CPU this device instead of the host one (e.g. to run whole test
files on the CUDA path: ``GOCKPT_SIMULATED_DEVICE=adversarial pytest tests/test_checkpointer.py``).

The live digests at F run at once on the digest thread, as on the host: marks are complete
when taken (the CPU's training work is done as it is issued, and every stream wait has
already run the copies it waits for), so a digest behind a mark has nothing left to force.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Deque, Dict, Optional

import torch

from ..core.errors import ConfigError
from .device import AsyncDevice

EAGER = "eager"
ADVERSARIAL = "adversarial"
SETTINGS = (EAGER, ADVERSARIAL)
POISON = 0xFF  # the byte a destination holds until its copy has run (NaN in float32)

GRAD_STREAM = "grad"
STATE_STREAM = "state"
_STREAMS = (GRAD_STREAM, STATE_STREAM)  # the worker's order of preference


class SimEvent:
    """Completion of the copies enqueued on one stream of a simulated device up to a point
    (``seq``: the enqueue it stands behind); an event of no stream is complete."""

    def __init__(self, device: Optional["SimulatedAsyncDevice"] = None,
                 stream: Optional[str] = None, seq: int = 0):
        self.device, self.stream, self.seq = device, stream, seq

    def query(self) -> bool:
        """Whether the copies are done (never makes them run)."""
        return self.device is None or self.device.completed(self.stream, self.seq)

    def synchronize(self) -> None:
        """Have the copies run (up to this event, in stream order) and wait for them; raises
        the error of a copy that failed."""
        if self.device is not None:
            self.device.force(self.stream, self.seq)


class _Copy:
    """One enqueued copy: its destination, its source (kept alive until it ran; None for the
    marker of an empty enqueue), its stream and the enqueue it belongs to (``last``: it
    completes that enqueue)."""

    __slots__ = ("dst", "src", "stream", "seq", "last")

    def __init__(self, dst, src, stream, seq, last):
        self.dst, self.src, self.stream, self.seq, self.last = dst, src, stream, seq, last


class SimulatedAsyncDevice(AsyncDevice):
    """CPU tensors on the asynchronous (CUDA) path of the device layer; see the module.

    ``setting``: ``"eager"`` or ``"adversarial"``. ``history`` holds the last copies run, as
    (stream, enqueue number), in the order the worker ran them (for tests).
    """

    kind = "cpu"

    def __init__(self, setting: str = ADVERSARIAL):
        if setting not in SETTINGS:
            raise ConfigError(f"GOCKPT_SIMULATED_DEVICE must be one of {', '.join(SETTINGS)}, "
                              f"got {setting!r}")
        self.setting = setting
        self._cv = threading.Condition()
        self._queues: Dict[str, Deque[_Copy]] = {s: collections.deque() for s in _STREAMS}
        self._issued = {s: 0 for s in _STREAMS}  # enqueues made per stream
        self._completed_seq = {s: 0 for s in _STREAMS}  # enqueues whose copies all ran
        self._forced = {s: 0 for s in _STREAMS}  # enqueues that must run now (adversarial)
        self._held = 0  # hold(): the worker starts nothing unforced
        self._running = False  # the worker is running a copy
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None  # started with the first copy
        self.history: Deque = collections.deque(maxlen=4096)

    # ------------------------------------------------------------ the AsyncDevice primitives

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer holding poison: what was never copied into it reads wrong."""
        buf = torch.empty(numel, dtype=dtype)
        _poison(buf)
        return buf

    def enqueue(self, pairs, high_priority: bool) -> SimEvent:
        """Enqueue copies ``dst <- src`` on the gradient (``high_priority``) or state stream,
        behind the training work issued so far (all of it done: the CPU runs it as issued);
        returns the event behind them. The destinations hold poison until the copies run."""
        pairs = list(pairs)
        for i, (dst, src) in enumerate(pairs):
            if dst.numel() != src.numel() or dst.dtype != src.dtype or dst.is_cuda or src.is_cuda:
                raise ValueError(f"copy {i}: dst ({dst.dtype}, {dst.numel()} elements) and src "
                                 f"({src.dtype}, {src.numel()}) must be CPU tensors of one "
                                 "dtype and size")
        stream = GRAD_STREAM if high_priority else STATE_STREAM
        with self._cv:
            if self._closed:
                raise RuntimeError("the simulated device is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gockpt-simdev",
                                                daemon=True)
                self._thread.start()
            self._issued[stream] += 1
            seq = self._issued[stream]
            for i, (dst, src) in enumerate(pairs):
                _poison(dst)  # the bytes are the copy's from now on, valid only at its event
                self._queues[stream].append(_Copy(dst, src, stream, seq, i == len(pairs) - 1))
            if not pairs:  # an event behind what the stream holds: a marker completes it
                self._queues[stream].append(_Copy(None, None, stream, seq, True))
            self._cv.notify_all()
        return SimEvent(self, stream, seq)

    def wait_event(self, event) -> None:
        """"The compute stream waits for ``event``": CPU work cannot be queued behind a copy,
        so this (training) thread has the copies up to the event run, and waits for them."""
        event.synchronize()

    def mark(self) -> SimEvent:
        """The training work issued so far: all done (and every copy it was ordered after)."""
        return SimEvent()

    @contextlib.contextmanager
    def behind(self, mark):
        """Run the block's work behind ``mark`` (here: at once, ``mark`` being complete); the
        yielded dict gets a complete event."""
        mark.synchronize()
        done: dict = {}
        yield done
        done["event"] = SimEvent()

    def close(self) -> None:
        """Run every queued copy, then stop the worker; later enqueues raise."""
        with self._cv:
            self._closed = True
            for s in _STREAMS:
                self._forced[s] = self._issued[s]
            self._cv.notify_all()
            while self._thread is not None and any(self._queues.values()):
                self._cv.wait()
            thread, self._thread = self._thread, None
            self._cv.notify_all()
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ for tests

    @contextlib.contextmanager
    def hold(self):
        """While held, the worker starts no copy that nothing forces (so that a test can queue
        several groups before the eager worker chooses among them)."""
        with self._cv:
            self._held += 1
        try:
            yield self
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify_all()

    def idle(self) -> int:
        """Wait, without forcing anything, until the worker has no copy it may run (eager:
        all done, unless held; adversarial: the forced ones); returns how many are left."""
        with self._cv:
            while self._running or self._may_run() is not None:
                self._cv.wait()
            return sum(len(q) for q in self._queues.values())

    def pending(self) -> int:
        """How many enqueued copies have not run yet."""
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    # ------------------------------------------------------------------ internals

    def completed(self, stream: str, seq: int) -> bool:
        with self._cv:
            return self._completed_seq[stream] >= seq

    def force(self, stream: str, seq: int) -> None:
        """Have the copies of ``stream`` up to enqueue ``seq`` run and wait for them."""
        with self._cv:
            if self._forced[stream] < seq:
                self._forced[stream] = seq
                self._cv.notify_all()
            while self._completed_seq[stream] < seq:
                self._cv.wait()
            if self._error is not None:  # sticky, as a CUDA error is
                raise RuntimeError(f"a simulated copy failed: {self._error}") from self._error

    def _may_run(self) -> Optional[str]:
        """The stream whose next copy may run now (lock held): a forced one first, gradients
        before state; in the eager setting, else any, gradients first; None: none yet."""
        for s in _STREAMS:
            q = self._queues[s]
            if q and q[0].seq <= self._forced[s]:
                return s
        if self.setting == EAGER and not self._held:
            for s in _STREAMS:
                if self._queues[s]:
                    return s
        return None

    def _next(self) -> Optional[_Copy]:
        """Take the copy to run now (lock held), or None."""
        stream = self._may_run()
        if stream is None:
            return None
        self._running = True
        return self._queues[stream].popleft()

    def _run(self) -> None:
        """The worker: one copy at a time, chosen again after each (stream order kept)."""
        while True:
            with self._cv:
                copy = self._next()
                while copy is None:
                    if self._closed and not any(self._queues.values()):
                        self._cv.notify_all()
                        return
                    self._cv.wait()
                    copy = self._next()
            try:
                if copy.dst is not None:
                    copy.dst.copy_(copy.src)  # the source as it is now, not as at enqueue
            except BaseException as exc:  # surfaced by the waiters (SimEvent.synchronize)
                with self._cv:
                    self._error = exc
                    self._cv.notify_all()
            with self._cv:
                self._running = False
                self.history.append((copy.stream, copy.seq))
                if copy.last:
                    self._completed_seq[copy.stream] = copy.seq
                self._cv.notify_all()
            copy.dst = copy.src = None  # the source may go now (record_stream's end)


def _poison(t: torch.Tensor) -> None:
    """Fill ``t``'s bytes with POISON."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(POISON)
    else:  # never the case for the staging views; keep the pattern recognisable anyway
        t.fill_(float("nan") if t.is_floating_point() else -1)
