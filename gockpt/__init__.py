"""gockpt: gradient-assisted multi-step overlapped checkpointing for PyTorch training.

Public API::

    ck = gockpt.Checkpointer(model, optimizer, "checkpoints/run1", mode="gockpt-o")
    ... ck.backward_begin(); ck.update_begin(); ck.save_checkpoint(step) ...
    ck.close()
    restored = gockpt.load("checkpoints/run1", model, optimizer, scheduler=scheduler)
    report = gockpt.verify("checkpoints/run1")   # every checksum, without loading; report.ok

    gockpt.replay_step("cuda/torch/AdamW/fused", p, exp_avg, exp_avg_sq, grad, lr=1e-3,
                       betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1)
    gockpt.replay_arithmetics()  # the profiles replay_step reproduces bit for bit
"""

from .checkpointer import CheckpointHandle, Checkpointer
from .core.config import Config
from .core.remote_options import RemoteOptions
from .core.errors import (CheckpointFailedError, CheckpointNotFoundError, ConfigError,
                     ConsistencyError, CorruptCheckpointError, DirectoryInUseError, GockptError,
                     HookOrderError, LayoutChangedError, LoadError, StorageError,
                     UnsupportedOptimizerError, UnsupportedTensorError, WaitTimeoutError)
from .loading import Restored, load
from .core.modes import MODES
from .replay.arithmetic import replay_arithmetics, replay_step
from .storage.verify import VerifyReport, verify
from .core import metrics  # noqa: F401  (public: gockpt.metrics.read(directory))

__version__ = "0.1.0"

__all__ = [
    "RemoteOptions",
    "Checkpointer", "CheckpointHandle", "Config", "MODES", "load", "Restored", "verify",
    "VerifyReport",
    "GockptError", "ConfigError", "UnsupportedOptimizerError", "HookOrderError",
    "CheckpointNotFoundError", "CorruptCheckpointError", "StorageError", "LoadError",
    "ConsistencyError", "CheckpointFailedError", "DirectoryInUseError", "LayoutChangedError",
    "UnsupportedTensorError", "WaitTimeoutError",
    "replay_step",
    "replay_arithmetics",
]
