"""gockpt.capture.device: the device layer is chosen from where the training tensors live."""

from __future__ import annotations

import gc

import pytest
import torch

from gockpt.capture.device import AsyncDevice, CudaDevice, HostDevice, pinned_exact
from gockpt.capture.devices import device_for
from gockpt.core.errors import ConfigError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_tensors_get_the_host_device():
    dev = device_for([torch.zeros(3), torch.zeros(2, 2)])
    assert isinstance(dev, HostDevice)
    assert dev.kind == "cpu" and not isinstance(dev, AsyncDevice)
    assert isinstance(device_for([]), HostDevice)  # a model without parameters


def test_host_device_allocates_and_copies():
    dev = HostDevice()
    buf = dev.empty(5, torch.float16)
    assert buf.shape == (5,) and buf.dtype == torch.float16 and buf.device.type == "cpu"
    src = torch.arange(5, dtype=torch.float16)
    dev.copy(buf, src)
    assert torch.equal(buf, src)


def test_mixed_devices_are_refused():
    with pytest.raises(ConfigError, match=r"several devices.*cpu.*meta"):
        device_for([torch.zeros(1), torch.zeros(1, device="meta")])


def test_unsupported_device_type_is_refused():
    with pytest.raises(ConfigError, match="'meta' are not supported"):
        device_for([torch.zeros(1, device="meta")])


def test_pinned_buffers_are_registered_at_their_size_until_the_last_view_is_gone():
    """The GPU's host buffers (CudaDevice.empty) pin exactly the bytes asked -- torch's own
    pinned allocator rounds each up to a power of two -- and stay pinned while any view of
    them lives: unpinning memory a copy may still write would hand it back to the system."""
    calls = []
    buf = pinned_exact(3000, torch.float32, lambda a, n: calls.append(("register", a, n)) or True,
                       lambda a: calls.append(("unregister", a)), fallback=None)
    assert buf.shape == (3000,) and buf.dtype == torch.float32 and buf.is_contiguous()
    assert calls == [("register", buf.data_ptr(), 12000)]
    address, view = buf.data_ptr(), buf[100:200]
    buf[150] = 7.0
    del buf
    gc.collect()
    assert len(calls) == 1 and float(view[50]) == 7.0  # the view still holds it
    del view
    gc.collect()
    assert calls == [("register", address, 12000), ("unregister", address)]


def resident_fraction(address: int, nbytes: int) -> float:
    """The fraction of the pages of a page-aligned range that are in memory (mincore)."""
    import ctypes
    import mmap
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0
    return sum(v & 1 for v in vec) / pages


def test_the_pages_are_faulted_in_before_the_driver_registers_them(monkeypatch):
    """Faulting pages in while registering holds the driver's locks (the training thread's
    CUDA calls wait): the buffer is touched first, in several chunks."""
    from gockpt.capture import device
    monkeypatch.setattr(device, "PREFAULT_CHUNK", 1 << 16)
    seen = []
    buf = pinned_exact(300_000, torch.float32,
                       lambda a, n: seen.append(resident_fraction(a, n)) or True,
                       lambda a: None, fallback=None)
    assert seen == [1.0] and int(buf.count_nonzero()) == 0


def test_pinned_buffers_fall_back_where_registering_fails():
    calls = []
    fallback = torch.zeros(5, dtype=torch.bfloat16)
    buf = pinned_exact(5, torch.bfloat16, lambda a, n: False, calls.append, lambda: fallback)
    assert buf is fallback
    gc.collect()
    assert calls == []  # what was not registered is not unregistered
    assert pinned_exact(0, torch.float32, None, None, None).numel() == 0


@cuda
def test_cuda_tensors_get_the_cuda_device_with_pinned_buffers():
    dev = device_for([torch.zeros(3, device="cuda")])
    assert isinstance(dev, CudaDevice)
    assert dev.kind == "cuda" and isinstance(dev, AsyncDevice)
    assert dev.empty(4, torch.float32).is_pinned()


@cuda
def test_cuda_copies_complete_at_their_event():
    dev = device_for([torch.zeros(1, device="cuda")])
    src = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    dst = dev.empty(src.numel(), src.dtype)
    for high in (True, False):
        dst.zero_()
        dev.enqueue([(dst, src)], high_priority=high).synchronize()
        assert torch.equal(dst, src.cpu())
