"""gockpt.capture.device: the device layer is chosen from where the training tensors live."""

from __future__ import annotations

import pytest
import torch

from gockpt.capture.device import AsyncDevice, CudaDevice, HostDevice
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
