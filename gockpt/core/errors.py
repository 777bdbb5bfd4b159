"""Exceptions raised by gockpt. Every error a user can cause or meet is one of these."""

import enum


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


class Adaptation(enum.Enum):
    """What the next checkpoints do about a checkpoint refused for a reason outside gockpt's
    replay (the ``adapt`` of its :class:`ConsistencyError`): training goes on with a
    warning, and ``handle.wait()`` still raises."""

    COPY_AT_F = "copy at F"  # tensors written outside the optimizer: copied at F from now on
    REPLAN = "replan"        # the optimizer's parameters changed: planned again
    NEW_STATE = "new state"  # an optimizer state was replaced: the next one reads the new one


class ConsistencyError(GockptError):
    """What was staged is not the state at version F: a replay that differs from a direct copy
    or from the live tensors, or (``adapt`` given) something outside the optimizer changed what
    the checkpoint read -- ``tensors`` names them for :attr:`Adaptation.COPY_AT_F`."""

    def __init__(self, message, adapt: "Adaptation | None" = None, tensors=()):
        super().__init__(message)
        self.adapt = adapt
        self.tensors = tuple(tensors)

    def __reduce__(self):  # picklable with its outcome
        return (type(self), (str(self), self.adapt, self.tensors))


class CheckpointFailedError(GockptError):
    """A checkpoint failed in the background; ``__cause__`` holds the original error."""

    def __init__(self, message, final_step=None):
        super().__init__(message)
        self.final_step = final_step


class WaitTimeoutError(GockptError, TimeoutError):
    """A wait for a checkpoint ended at its timeout; the message says what the checkpoint
    still waits for. The checkpoint itself goes on."""

    def __init__(self, message, final_step=None):
        super().__init__(message)
        self.final_step = final_step
