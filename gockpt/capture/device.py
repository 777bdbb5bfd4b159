"""The one place that knows whether state lives on a GPU or on the CPU.

On a GPU, copies to the host run on side CUDA streams into pinned host buffers and are
tracked with events; on the CPU, a copy is a plain host memcpy run by the transfer thread.
Everything above this module is written once for both.
"""

from __future__ import annotations

import contextlib

import torch

from ..core.errors import ConfigError
from ..core.staging import Arena


class HostDevice:
    """Training tensors on the CPU: host buffers are ordinary memory, copies are memcpy."""

    kind = "cpu"
    asynchronous_copies = False  # the transfer thread performs each copy itself

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host staging buffer."""
        return torch.empty(numel, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy now, in the calling thread (the transfer thread)."""
        dst.copy_(src)

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

    def device_arena(self, dtype: torch.dtype, sizes):
        """An arena in device memory (here: host memory standing for it)."""
        return Arena(self, dtype, sizes)

    def copy_now(self, dst, src, nbytes) -> None:
        """Device-local copies (addresses as numpy arrays), done when this returns: at memory
        speed, never through the (possibly emulated, paced) device-to-host link."""
        from gockpt import _C
        if self._local is None:
            self._local = _C.CopyEngine(0.0)
        ticket = self._local.submit(0, dst, src, nbytes)
        self._local.wait(ticket)
        self._local.release(ticket)

    _local = None


class CudaDevice:
    """Training tensors on a GPU: pinned host buffers, side streams (gradients on a
    high-priority stream so that they overtake state copies), completion by events."""

    kind = "cuda"
    asynchronous_copies = True

    def __init__(self, device: torch.device):
        self.device = device
        # Lower number = higher priority in CUDA.
        self.grad_stream = torch.cuda.Stream(device=device, priority=-1)
        self.state_stream = torch.cuda.Stream(device=device, priority=0)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def order_after(self, ticket) -> None:
        """Kernels queued on the compute stream from now on wait for ``ticket``'s copies (on
        the GPU; the CPU goes on)."""
        if ticket.cuda_event is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket.cuda_event)
        elif ticket.error is not None:
            raise ticket.error

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

    def order_after_digests(self, ticket) -> None:
        """Kernels queued on the compute stream from now on wait for ``ticket``'s digests to
        have read the live tensors (on the GPU; the CPU waits only until they are queued)."""
        ticket.reads_done.wait()
        if ticket.done_event is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket.done_event)

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


def device_for(tensors) -> "HostDevice | CudaDevice":
    """Pick the device layer from where the training tensors live (all on one device)."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ConfigError(
            f"parameters live on several devices ({sorted(map(str, devices))}); gockpt "
            "checkpoints one device per process: give each rank its own Checkpointer")
    dev = next(iter(devices), torch.device("cpu"))
    if dev.type == "cuda":
        return CudaDevice(dev)
    if dev.type != "cpu":
        raise ConfigError(f"parameters on device type {dev.type!r} are not supported")
    return HostDevice()
