"""Storage: version F from host memory to a committed, verifiable checkpoint, and back.

    format.py    names, dtype codes, the data file's layout (safetensors-compatible, aligned)
    manifest.py  the manifest's typed sections, tensor names, rank parts, validation
    io.py        the C++ parallel writer/reader and crc32c (gockpt._C)
    writer.py    CheckpointWriter: one checkpoint's data file, manifest and commit
    reader.py    the validated manifest and parallel, checksummed reads
    pagecache.py which byte ranges of a file are in the page cache (buffered vs O_DIRECT reads)
    commit.py    atomic publish, ``latest``, listing, retention, leftovers of dead writers
    persist.py   the persist thread: streams blocks as they reach F, commits
    ranks.py     several ranks committing one checkpoint together
    shares.py    reading a checkpoint whose replicas wrote one state in shares
    verify.py    checking a checkpoint without loading it (gockpt.verify)
    tree.py      Python state as JSON plus tensors (never pickle)
"""

from ..core.lazy import submodule
from .commit import cleanup_temporaries, list_checkpoints, resolve
from .format import (ALIGN, CHUNK_BYTES, CODE_TO_DTYPE, DATA_FILE, DTYPE_TO_CODE, FORMAT,
                     FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, PAD_PREFIX, TMP_PREFIX,
                     checkpoint_name)
from .manifest_file import read_manifest
from .reader import read_tensors
from .writer import CheckpointWriter

__all__ = [
    "FORMAT", "FORMAT_VERSION", "DATA_FILE", "MANIFEST_FILE", "LATEST_FILE", "TMP_PREFIX",
    "PAD_PREFIX", "ALIGN", "CHUNK_BYTES", "DTYPE_TO_CODE", "CODE_TO_DTYPE", "checkpoint_name",
    "CheckpointWriter", "resolve", "list_checkpoints", "read_manifest", "read_tensors",
    "cleanup_temporaries",
]


def __getattr__(name: str):  # (a submodule, imported when first named: core/lazy.py)
    return submodule(__name__, name)
