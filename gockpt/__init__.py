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

import importlib as _importlib
from typing import TYPE_CHECKING

# Every error is light (no torch) and imported at once; the rest is imported where it is first
# used (``gockpt.Checkpointer``, ``from gockpt import load``): a tool that needs no torch --
# ``gockpt-interval``, ``python -m gockpt.cli.interval`` -- starts in a tenth of a second
# instead of the three that importing torch takes.
from .core.errors import (CheckpointFailedError, CheckpointNotFoundError, ConfigError,
                          ConsistencyError, CorruptCheckpointError, DirectoryInUseError,
                          GockptError, HookOrderError, LayoutChangedError, LoadError,
                          StorageError, UnsupportedOptimizerError, UnsupportedTensorError,
                          WaitTimeoutError)
from .core.lazy import submodule as _submodule

if TYPE_CHECKING:  # (what type checkers and IDEs see; at run time: __getattr__)
    from .checkpointer import CheckpointHandle, Checkpointer
    from .core import metrics
    from .core.config import Config
    from .core.modes import MODES
    from .core.remote_options import RemoteOptions
    from .loading import Restored, load
    from .replay.arithmetic import replay_arithmetics, replay_step
    from .storage.verify import VerifyReport, verify

__version__ = "0.1.0"

# public name -> the module that defines it (metrics, a module: gockpt.metrics.read(directory))
_LAZY = {"metrics": ".core",
         "Checkpointer": ".checkpointer", "CheckpointHandle": ".checkpointer",
         "Config": ".core.config", "RemoteOptions": ".core.remote_options",
         "MODES": ".core.modes", "load": ".loading", "Restored": ".loading",
         "verify": ".storage.verify", "VerifyReport": ".storage.verify",
         "replay_step": ".replay.arithmetic", "replay_arithmetics": ".replay.arithmetic"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
    else:  # a submodule (gockpt.storage.read_tensors); the C++ core of the tensors' reads
        if name == "_tensors":  # links libtorch, which torch's import loads first
            _importlib.import_module("torch")
        value = _submodule(__name__, name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__():
    return sorted(set(__all__) | set(_LAZY) | {"__version__"}
                  | {n for n in globals() if not n.startswith("_") and n != "TYPE_CHECKING"})


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
