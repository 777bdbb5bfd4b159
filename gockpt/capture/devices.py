"""Which device layer the training tensors get: :class:`~.device.HostDevice` for the CPU,
:class:`~.device.CudaDevice` for a GPU, or -- for CPU tensors, when ``GOCKPT_SIMULATED_DEVICE``
is ``eager`` or ``adversarial`` -- :class:`~.simulated.SimulatedAsyncDevice`, the CUDA path's
ordering run on the CPU (for tests and CI)."""

from __future__ import annotations

import os

import torch

from ..core.errors import ConfigError
from .device import CudaDevice, Device, HostDevice
from .simulated import SimulatedAsyncDevice

#: The environment variable that puts CPU training on the simulated asynchronous device.
SIMULATED_ENV = "GOCKPT_SIMULATED_DEVICE"


def device_for(tensors) -> Device:
    """Pick the device layer from where the training tensors live (all on one device); CPU
    tensors get the simulated asynchronous device when ``GOCKPT_SIMULATED_DEVICE`` is set
    (``eager`` or ``adversarial``: :mod:`gockpt.capture.simulated`)."""
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
    setting = os.environ.get(SIMULATED_ENV, "")
    if setting:
        return SimulatedAsyncDevice(setting)
    return HostDevice()
