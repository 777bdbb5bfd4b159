"""gockpt: gradient-assisted multi-step overlapped checkpointing for PyTorch training.

Public API::

    ck = gockpt.Checkpointer(model, optimizer, "checkpoints/run1", mode="gockpt-o")
    ... ck.backward_begin(); ck.update_begin(); ck.save_checkpoint(step) ...
    ck.close()
    restored = gockpt.load("checkpoints/run1", model, optimizer, scheduler=scheduler)
"""

from .checkpointer import CheckpointHandle, Checkpointer
from .config import Config
from .errors import (CheckpointFailedError, CheckpointNotFoundError, ConfigError,
                     ConsistencyError, CorruptCheckpointError, GockptError, HookOrderError,
                     LoadError, StorageError, UnsupportedOptimizerError)
from .loading import Restored, load
from .modes import MODES
from . import metrics  # noqa: F401  (gockpt.metrics.read)

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "CheckpointHandle", "Config", "MODES", "load", "Restored",
    "GockptError", "ConfigError", "UnsupportedOptimizerError", "HookOrderError",
    "CheckpointNotFoundError", "CorruptCheckpointError", "StorageError", "LoadError",
    "ConsistencyError", "CheckpointFailedError",
]
