"""The one place that knows whether state lives on a GPU or on the CPU.

Everything above this module talks to a :class:`Device` and is written once for all of them;
it never asks which kind of device it has. Three implement it:

* :class:`HostDevice` -- training tensors on the CPU: host buffers are ordinary memory, a copy
  is a memcpy run by the transfer thread (``_C.CopyEngine``), and "ordering training work
  after a copy" means the training thread waits for it.
* :class:`CudaDevice` -- training tensors on a GPU: pinned host buffers, copies enqueued on
  side streams behind the compute stream, completion by CUDA events, ordering by stream waits.
* :class:`~gockpt.capture.simulated.SimulatedAsyncDevice` -- CPU tensors behaving like the
  CUDA device (enqueued copies that run late on a worker thread, events, poisoned
  destinations), chosen by ``GOCKPT_SIMULATED_DEVICE`` (see that module).

The last two share everything but a few primitives (:class:`AsyncDevice`), so a test run on
the simulated device exercises, line for line, the code the GPU runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ContextManager, List, Optional, Protocol, Tuple

import numpy as np
import torch

from gockpt import _C

from ..core.errors import GockptError
from ..core.staging import Arena
from .transfer import GRADIENT, Ticket


class CopyGroup(Protocol):
    """One group of device-to-host copies, described in both forms a device may take; the
    device calls exactly one of them, once, inside :meth:`Device.submit` (training thread)."""

    def segments(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """``(dst, src, nbytes, keep)``: host addresses and sizes (int64 arrays of one length)
        of memcpy segments, and the objects whose memory they use (alive until the copies
        ran). ValueError, naming it, for a copy that cannot run (the ticket then fails)."""

    def pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(host destination, live source)`` tensors, each pair contiguous, of one dtype and
        size, for a device that enqueues tensor copies."""


class Device(Protocol):
    """What the capture stages ask of the device holding the training tensors.

    Threads: the *training thread* runs the loop's hooks and the optimizer's step hooks; the
    *staging thread* allocates host memory at construction; the *digest thread* digests live
    tensors at F; the *transfer thread* (host engine) and the *replay thread* wait on tickets.
    "Training work issued from now on" means the kernels (or, on the CPU, the Python calls)
    that the training thread issues after the method returns.
    """

    kind: str
    """Where the training tensors live ("cpu", "cuda"): for messages and for comparing two
    devices (a replan must find the new parameters on the same kind); never branched on."""

    overlap_needs_snapshot: bool
    """Whether a gradient copy that overlaps the update (gockpt-o) must read a device-side
    snapshot (taken with :meth:`device_arena` and :meth:`copy_now`) rather than ``.grad``
    itself: True where training work cannot be queued behind the copy (the CPU), so that the
    step is not held up by the slow copy."""

    copies_segments: bool
    """Whether :meth:`submit` takes a group's memcpy segments (``CopyGroup.segments``), whose
    sources are read with the parameters' strides checked in the same pass -- a checkpoint's
    start then leaves :func:`gockpt.core.planning.check_layouts` to them -- rather than its
    tensor pairs."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host staging buffer that copies may target (pinned on a GPU). Staging
        thread, at construction (or the first checkpoint); its contents are undefined."""

    def submit(self, engine, group: CopyGroup, priority: int) -> Ticket:
        """Queue ``group``'s copies (``priority``: GRADIENT before STATE before SNAPSHOT)
        through ``engine`` (a :class:`~gockpt.capture.transfer.CopyEngine` of this device).
        Training thread.
        Before: the sources hold the version to copy, and every write of them issued so far
        precedes the copies. After: the destinations are valid only once the ticket is done
        (``wait``/``done``); the sources must not be written, nor freed, by training work
        until :meth:`order_after` (or ``wait``) on the ticket -- the device keeps what it
        reads alive itself. A copy that cannot run fails the ticket (raised by ``wait``)."""

    def order_after(self, ticket: Ticket) -> None:
        """Training work issued from now on runs after ``ticket``'s copies have landed (the
        CPU: this thread waits; a GPU: the compute stream waits, the thread goes on). Training
        thread, before it writes (or frees) what the copies read. Raises the ticket's error."""

    def mark(self):
        """A marker of the training work issued so far (the state of the live tensors now),
        for :meth:`behind`. Training thread."""

    def behind(self, mark) -> ContextManager[dict]:
        """Run the block's device work (a digest's) after the work ``mark`` marks. Digest
        thread. The yielded dict gets ``"event"``, complete once that work is, when the work
        completes after the block ends (nothing: done when the block ends)."""

    def order_after_digests(self, ticket) -> None:
        """Training work issued from now on runs after the digests of ``ticket`` (a
        :class:`gockpt.core.digest.Ticket`) have read the live tensors. Training thread,
        before the next optimizer update."""

    def device_arena(self, dtype: torch.dtype, extents) -> Arena:
        """An arena in device memory (slot -> the (lo, hi) elements held) for the gradient
        snapshot. Training
        thread; called only when :attr:`overlap_needs_snapshot`."""

    def copy_now(self, dst, src, nbytes) -> None:
        """Device-local copies by address (int64 numpy arrays), complete when this returns.
        Training thread; called only when :attr:`overlap_needs_snapshot`."""

    def close(self) -> None:
        """Complete every queued copy and stop the device's own threads. Called once, by
        ``CopyEngine.close`` when the Checkpointer closes; nothing is submitted after."""

    def settle(self) -> None:
        """Any thread: wait until the training work queued on the device so far is done, so
        that another thread can go on where the training loop's thread (ended) left off."""


class HostDevice:
    """Training tensors on the CPU: host buffers are ordinary memory, copies are memcpy."""

    kind = "cpu"
    overlap_needs_snapshot = True  # nothing can be queued behind a copy: snapshot, go on
    copies_segments = True

    def settle(self) -> None:
        pass  # training work on the CPU is done when its call returns

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host staging buffer."""
        return torch.empty(numel, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy now, in the calling thread (the transfer thread)."""
        dst.copy_(src)

    def submit(self, engine, group: CopyGroup, priority: int) -> Ticket:
        """Whole groups of memcpy segments to the host engine's thread (one call each)."""
        try:
            dst, src, nbytes, keep = group.segments()
        except GockptError:
            raise  # the live tensors are not as planned (LayoutChangedError): nothing queued
        except ValueError as exc:  # a copy that cannot run fails its ticket (at wait())
            return Ticket(0, 0, error=RuntimeError(str(exc)))
        if not len(dst):
            return Ticket(0, 0)
        return engine.submit_own(dst, src, nbytes, priority).keep(keep)

    def order_after(self, ticket) -> None:
        """Training work issued from now on must not run before ``ticket``'s copies have
        landed. The CPU has no stream to order on: the training thread waits."""
        ticket.wait()

    def mark(self):
        """A marker of the training work issued so far (the CPU runs it as it is issued)."""
        return None

    @contextlib.contextmanager
    def behind(self, mark):
        """Run work (a digest thread's) after what ``mark`` marks: here, at once. Yields a
        dict that gets no event: the work is done when the block ends."""
        yield {}

    def order_after_digests(self, ticket) -> None:
        """The next update must not run before ``ticket``'s digests have read the live
        tensors: the training thread waits for them."""
        ticket.reads_done.wait()

    def device_arena(self, dtype: torch.dtype, extents):
        """An arena in device memory (here: host memory standing for it)."""
        return Arena(self, dtype, extents)

    def copy_now(self, dst, src, nbytes) -> None:
        """Device-local copies (addresses as numpy arrays), done when this returns: at memory
        speed, never through the (possibly emulated, paced) device-to-host link; on this
        thread (a hand-off to a copy thread costs its wake-up, more than the copy)."""
        _C.copy_now(dst, src, nbytes)

    def close(self) -> None:
        """Nothing of its own runs: the host engine's thread is the CopyEngine's."""


class AsyncDevice:
    """A device whose copies are enqueued behind the training work and complete at events
    (:class:`CudaDevice`, and the simulated one). Everything the stages call is here, written
    once; a subclass provides the primitives: :meth:`empty`, :meth:`enqueue` (copies behind
    the work issued so far, returning their event: ``query()``/``synchronize()``),
    :meth:`wait_event` (the compute stream waits for an event), :meth:`mark`, :meth:`behind`.
    """

    overlap_needs_snapshot = False  # the compute stream waits for the copies instead
    copies_segments = False  # (tensor pairs, enqueued one by one)

    def settle(self) -> None:
        """(The simulated device: training work on the CPU is done when its call returns.)"""

    def submit(self, engine, group: CopyGroup, priority: int) -> Ticket:
        """Enqueue the group's tensor copies on the stream of ``priority``; the ticket holds
        their event (the device keeps the sources alive until the copies have read them)."""
        pairs = group.pairs()
        if not pairs:
            return Ticket(0, 0)
        nbytes = sum(src.nbytes for _, src in pairs)
        event = self.enqueue(pairs, high_priority=priority == GRADIENT)
        engine.note_enqueued(nbytes)
        return Ticket(len(pairs), nbytes, event=event)

    def order_after(self, ticket) -> None:
        """Training work issued from now on waits for ``ticket``'s copies (on the device's
        compute stream; the calling thread goes on where the device can queue the wait)."""
        if ticket.event is not None:
            self.wait_event(ticket.event)
        elif ticket.error is not None:
            raise ticket.error

    def order_after_digests(self, ticket) -> None:
        """Training work issued from now on waits for ``ticket``'s digests to have read the
        live tensors (the calling thread waits only until they are queued)."""
        ticket.reads_done.wait()
        if ticket.done_event is not None:
            self.wait_event(ticket.done_event)

    def device_arena(self, dtype: torch.dtype, extents):
        raise NotImplementedError("an asynchronous device takes no gradient snapshot "
                                  "(overlap_needs_snapshot is False)")

    def copy_now(self, dst, src, nbytes) -> None:
        raise NotImplementedError("an asynchronous device takes no gradient snapshot "
                                  "(overlap_needs_snapshot is False)")

    def close(self) -> None:
        """Nothing to stop (a subclass with threads overrides)."""


class CudaDevice(AsyncDevice):
    """Training tensors on a GPU: pinned host buffers, side streams (gradients on a
    high-priority stream so that they overtake state copies), completion by events."""

    kind = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        # Lower number = higher priority in CUDA.
        self.grad_stream = torch.cuda.Stream(device=device, priority=-1)
        self.state_stream = torch.cuda.Stream(device=device, priority=0)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        device = self.device

        def register(address: int, nbytes: int) -> bool:
            try:
                with torch.cuda.device(device):  # (called on the staging thread)
                    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1)) == 0
            except (RuntimeError, AttributeError):  # no runtime binding: torch's pinned memory
                return False

        def unregister(address: int) -> None:
            torch.cuda.synchronize(device)  # no copy into the buffer may still be running
            torch.cuda.cudart().cudaHostUnregister(address)

        return pinned_exact(numel, dtype, register, unregister,
                            lambda: torch.empty(numel, dtype=dtype, pin_memory=True))

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def wait_event(self, event) -> None:
        """Kernels queued on the compute stream from now on wait for ``event`` (on the GPU;
        the CPU goes on)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self):
        """An event behind the work queued so far on the compute stream (the state now)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def behind(self, mark):
        """Queue the block's work on a side stream behind ``mark`` (from any thread); the
        yielded dict gets ``"event"``, recorded behind that work."""
        if self._digest_stream is None:
            self._digest_stream = torch.cuda.Stream(device=self.device, priority=0)
        stream, done = self._digest_stream, {}
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(mark)
            yield done
            event = torch.cuda.Event()
            event.record(stream)
            done["event"] = event

    _digest_stream = None

    def enqueue(self, pairs, high_priority: bool):
        """Enqueue device-to-host copies behind the work already queued on the current stream;
        returns an event that completes when they are done."""
        stream = self.grad_stream if high_priority else self.state_stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                # The caching allocator must not hand src's memory to training before the
                # side stream has read it (gradients are freed by zero_grad(set_to_none=True)).
                src.record_stream(stream)
            done.record(stream)
        return done


class _PinnedMapping(mmap.mmap):
    """An anonymous mapping registered with the GPU's driver (page-locked), unregistered by
    ``unregister(address)`` before it is unmapped, when the last tensor on it is gone."""

    unregister: Optional[Callable[[int], None]] = None
    address = 0

    def __del__(self):
        if self.unregister is not None:
            try:
                self.unregister(self.address)
            except Exception:  # noqa: BLE001 -- (at interpreter exit the driver may be gone)
                pass


PREFAULT_CHUNK = 1 << 28


def prefault(address: int, nbytes: int, threads: int = 4) -> None:
    """Touch every page of ``[address, address + nbytes)`` (a fresh mapping), in chunks on a
    few threads without the GIL (ctypes releases it). Registering memory with the GPU's driver
    holds driver-wide locks -- every CUDA call of the training thread waits meanwhile -- and
    faulting the pages in is most of that time when the driver does it: on an H200, staging
    registered on a background thread cost the loop about 0.5 s per GB (docs/gpu.md). Faulted
    here first, the registration only pins them."""
    starts = range(0, nbytes, PREFAULT_CHUNK)
    with ThreadPoolExecutor(max(1, min(threads, len(starts))),
                            thread_name_prefix="gockpt-prefault") as pool:
        list(pool.map(lambda o: ctypes.memset(address + o, 0, min(PREFAULT_CHUNK, nbytes - o)),
                      starts))


def pinned_exact(numel: int, dtype: torch.dtype, register: Callable[[int, int], bool],
                 unregister: Callable[[int], None],
                 fallback: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements of ``dtype``, page-locked at exactly its size.

    torch's pinned allocator rounds every block up to a power of two (an 8.8 GB arena -- the
    fp32 parameters of a 2.2B model -- pins 17.2 GB, for each of a checkpoint's arenas), which
    a host copy sized to the state cannot afford. Here an anonymous mapping of the size asked
    is registered with ``register(address, nbytes)`` (True: done) and lives as long as any
    tensor viewing it; where registering fails, ``fallback()`` gives the buffer instead."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    mapping = _PinnedMapping(-1, nbytes)
    tensor = torch.frombuffer(mapping, dtype=dtype)  # holds the mapping while it lives
    prefault(tensor.data_ptr(), nbytes)
    if not register(tensor.data_ptr(), nbytes):
        return fallback()
    mapping.address, mapping.unregister = tensor.data_ptr(), unregister
    return tensor
