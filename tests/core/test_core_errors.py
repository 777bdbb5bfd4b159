"""gockpt.core.errors: every error is a GockptError, and the built-in class a caller would catch."""

import pytest

import gockpt
from gockpt.core import errors


@pytest.mark.parametrize("cls,builtin", [
    (errors.ConfigError, ValueError), (errors.UnsupportedOptimizerError, ValueError),
    (errors.LayoutChangedError, ValueError), (errors.HookOrderError, RuntimeError),
    (errors.CheckpointNotFoundError, FileNotFoundError), (errors.StorageError, OSError),
    (errors.DirectoryInUseError, OSError), (errors.CorruptCheckpointError, Exception),
    (errors.LoadError, Exception), (errors.ConsistencyError, Exception),
    (errors.CheckpointFailedError, Exception)])
def test_error_classes(cls, builtin):
    assert issubclass(cls, errors.GockptError) and issubclass(cls, builtin)
    assert getattr(gockpt, cls.__name__) is cls  # public


def test_checkpoint_failed_error_names_its_step():
    e = errors.CheckpointFailedError("failed", final_step=12)
    assert e.final_step == 12 and str(e) == "failed"
