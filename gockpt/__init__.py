"""gockpt: gradient-assisted multi-step overlapped checkpointing for PyTorch training.

Public API::

    ck = gockpt.Checkpointer(model, optimizer, "checkpoints/run1", mode="gockpt-o")
    ... ck.backward_begin(); ck.update_begin(); ck.save_checkpoint(step) ...
    ck.close()
    restored = gockpt.load("checkpoints/run1", model, optimizer, scheduler=scheduler)
    report = gockpt.verify("checkpoints/run1")   # every checksum, without loading; report.ok
"""

from .checkpointer import CheckpointHandle, Checkpointer
from .config import MODES, Config
from .errors import (CheckpointFailedError, CheckpointNotFoundError, ConfigError,
                     ConsistencyError, CorruptCheckpointError, GockptError, HookOrderError,
                     LoadError, StorageError, UnsupportedOptimizerError)
from .loading import Restored, load
from .storage.verify import VerifyReport, verify
from . import metrics

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "CheckpointHandle", "Config", "MODES", "load", "Restored", "verify",
    "VerifyReport",
    "GockptError", "ConfigError", "UnsupportedOptimizerError", "HookOrderError",
    "CheckpointNotFoundError", "CorruptCheckpointError", "StorageError", "LoadError",
    "ConsistencyError", "CheckpointFailedError",
]
