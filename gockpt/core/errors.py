"""Exceptions raised by gockpt. Every error a user can cause or meet is one of these."""


class GockptError(Exception):
    """Base class of every error gockpt raises."""


class ConfigError(GockptError, ValueError):
    """A Checkpointer or load argument is invalid (bad mode, mismatched model/optimizer, ...)."""


class UnsupportedOptimizerError(ConfigError):
    """The optimizer or one of its settings cannot be replayed bitwise.

    Raised at construction for the replaying modes; the modes that need no replay
    (``sync``, ``async``, ``async-o``) accept any optimizer.
    """


class UnsupportedTensorError(ConfigError):
    """A parameter is a tensor whose memory gockpt cannot address: a DTensor (FSDP2, tensor
    parallelism) or another wrapper subclass, a meta or not yet initialised (lazy) tensor, a
    quantized tensor. Raised at construction, in every mode."""


class LayoutChangedError(ConfigError):
    """A parameter's memory layout (strides) changed after the Checkpointer was built."""


class HookOrderError(GockptError, RuntimeError):
    """The training-loop hooks were called out of order."""


class CheckpointNotFoundError(GockptError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CorruptCheckpointError(GockptError):
    """Checksum mismatch, truncated or missing file, or an invalid manifest."""


class StorageError(GockptError, OSError):
    """Writing or committing a checkpoint failed (disk full, permission, bad path)."""


class DirectoryInUseError(StorageError):
    """Another Checkpointer (this process or another one) is writing the same directory."""


class LoadError(GockptError):
    """A checkpoint does not fit the objects it is being loaded into."""


class ConsistencyError(GockptError):
    """The self-check found replayed state that differs from a direct copy at version F."""


class CheckpointFailedError(GockptError):
    """A checkpoint failed in the background; ``__cause__`` holds the original error."""

    def __init__(self, message, final_step=None):
        super().__init__(message)
        self.final_step = final_step
