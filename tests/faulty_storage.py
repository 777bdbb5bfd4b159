"""A storage plugin for tests: a CheckpointWriter whose C++ writer fails one of its data pwrites."""

from gockpt import storage


def failing_writer(after_writes: int, err: int):
    """A ``storage_writer`` plugin whose pwrite number ``after_writes`` (0-based) and later ones
    fail with errno ``err``."""

    class FailingWriter(storage.CheckpointWriter):
        def begin(self, layout):
            super().begin(layout)
            self._data_writer.inject_fault(after_writes, err)

    return FailingWriter
