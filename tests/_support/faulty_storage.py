"""Storage plugins for tests: CheckpointWriters that fail a pwrite, write the wrong bytes, or
kill their process in the write."""

import os
import signal

from gockpt import storage


def failing_writer(after_writes: int, err: int):
    """A ``storage_writer`` plugin whose pwrite number ``after_writes`` (0-based) and later ones
    fail with errno ``err``."""

    class FailingWriter(storage.CheckpointWriter):
        def begin(self, layout):
            super().begin(layout)
            self._data_writer.inject_fault(after_writes, err)

    return FailingWriter


def misplacing_writer(tensor: str):
    """A ``storage_writer`` plugin that writes zeros instead of the stored tensor ``tensor``
    (its checksums are computed on the zeros, so they match): bytes that are intact on disk
    yet are not the training state -- what only the digests recorded at F can tell."""
    import torch

    class MisplacingWriter(storage.CheckpointWriter):
        def write(self, name, t, *, start=0):
            super().write(name, torch.zeros_like(t) if name == tensor else t, start=start)

        def write_tensors(self, tensors):
            return super().write_tensors({n: torch.zeros_like(t) if n == tensor else t
                                          for n, t in tensors.items()})

    return MisplacingWriter


def killing_writer():
    """A ``storage_writer`` plugin class whose writer, once its ``armed`` is set, kills its
    process (SIGKILL: no handler, no vote) as it writes a checkpoint's tensors."""

    class KilledInWrite(storage.CheckpointWriter):
        armed = False

        def write_tensors(self, tensors):
            if KilledInWrite.armed:
                import torch.distributed as dist
                print(f"rank {dist.get_rank()}: killed in the write", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return super().write_tensors(tensors)

    return KilledInWrite
