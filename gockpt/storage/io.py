"""Thin wrapper over the parallel checkpoint I/O of ``gockpt._C`` (``csrc/crc32c.h``,
``csrc/writer.h``, ``csrc/reader.h``; bound in ``csrc/module.cpp``): thread and O_DIRECT
defaults, the once-only fallback warning, keeping submitted memory alive.

* ``crc32c(data, crc=0)``: Castagnoli CRC (AVX-512 carry-less multiplies, else SSE4.2, else a
  table: :func:`crc32c_impl`), zlib-style continuation; ``crc32c(b"123456789") == 0xE3069283``.
* ``Writer``: several threads pwrite tensor bytes at precomputed, 4096-aligned offsets of one
  file, with O_DIRECT where the file system accepts it (else buffered writes + fsync, logged
  once), checksumming every chunk while the data passes; ``finish`` returns a
  ``_C.FinishResult``.
* ``read_into``: several threads pread byte ranges straight into destination memory,
  verifying the per-chunk checksums (buffered: each 256 KiB piece checksummed as it lands, in
  cache); every item checked first; returns a ``_C.ReadResult``.

Knobs: ``GOCKPT_IO_THREADS`` (default: the number of cores for writing, twice that for
reading) and ``GOCKPT_IO_DIRECT=0`` (force
buffered I/O); both can also be passed per call.
"""

from __future__ import annotations

import logging
import os
import threading

from gockpt import _C

__all__ = ["crc32c", "crc32c_combine", "crc32c_impl", "Writer", "read_into", "default_threads",
           "default_read_threads", "default_direct", "ALIGN"]

log = logging.getLogger("gockpt")

ALIGN = 4096

_said_fallback = False
_said_lock = threading.Lock()


def crc32c(data, crc: int = 0) -> int:
    """crc32c of a bytes-like object (C-contiguous), continuing from ``crc``."""
    return _C.crc32c(memoryview(data).cast("B"), crc)


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B)."""
    return _C.crc32c_combine(crc1, crc2, len2)


def crc32c_impl() -> str:
    """'avx512-vpclmulqdq', 'sse4.2' or 'software'."""
    return _C.crc32c_impl()


def default_threads() -> int:
    """Writer threads: ``GOCKPT_IO_THREADS`` if it is an int >= 1, else the number of cores."""
    env = os.environ.get("GOCKPT_IO_THREADS")
    if env:
        try:
            n = int(env)
            if n >= 1:
                return n
        except ValueError:
            pass
        log.warning("gockpt: ignoring GOCKPT_IO_THREADS=%r (not an int >= 1)", env)
    return os.cpu_count() or 2


def default_read_threads() -> int:
    """Reader threads: twice the cores (they mostly wait on the disk), or GOCKPT_IO_THREADS."""
    if os.environ.get("GOCKPT_IO_THREADS"):
        return default_threads()
    return 2 * (os.cpu_count() or 2)


def default_direct() -> bool:
    """Whether to try O_DIRECT: yes unless ``GOCKPT_IO_DIRECT`` is 0/false/no/off."""
    return os.environ.get("GOCKPT_IO_DIRECT", "1").strip().lower() not in ("0", "false", "no", "off")


def _say_fallback(path: str, reason: str) -> None:
    global _said_fallback
    with _said_lock:
        first, _said_fallback = not _said_fallback, True
    (log.warning if first else log.debug)(
        "gockpt: writing checkpoints with buffered I/O + fsync instead of O_DIRECT (%s; file %s)%s",
        reason, path, "" if first else "")


class Writer:
    """One file written by a pool of threads; see ``csrc/writer.h`` for the layout contract.

    ``tensors`` is a list of (file offset, nbytes): offsets multiples of 4096, the header
    (``len(header)`` a multiple of 4096) at offset 0, ``file_size`` a multiple of 4096.
    Every tensor's bytes are checksummed per chunk of ``chunk_bytes`` (a multiple of 4096).
    Creates the file (O_EXCL), reserves its size and writes the header before returning.
    """

    def __init__(self, path: str, file_size: int, header: bytes, tensors, *, chunk_bytes: int,
                 threads: int | None = None, direct: bool | None = None):
        threads = default_threads() if threads is None else int(threads)
        want_direct = default_direct() if direct is None else bool(direct)
        self._owners: list = []  # objects owning submitted memory, kept until close()
        self._w = _C.IoWriter(path, file_size, header, list(tensors), chunk_bytes, threads, want_direct)
        self.path = path
        self.direct = self._w.direct
        self.threads = self._w.threads
        if want_direct and not self.direct:
            _say_fallback(path, self._w.fallback_reason)

    def submit(self, index: int, address: int, start: int, nbytes: int, owner=None) -> None:
        """Queue ``nbytes`` at ``address`` as bytes [start, start+nbytes) of tensor ``index``.

        The memory must stay unchanged until ``finish`` or ``close`` returns; ``owner`` (e.g.
        the tensor) is kept alive until ``close``.
        """
        if owner is not None:
            self._owners.append(owner)
        self._w.submit(index, address, start, nbytes)

    def finish(self):
        """Wait for the queued writes, check that every tensor byte was written exactly once,
        fsync. Returns a ``_C.FinishResult``: ``err`` (0, an errno, or -1 with ``bad_tensor``
        and ``bad_offset``), ``msg``, and ``crcs`` (per tensor, per chunk)."""
        return self._w.finish()

    def close(self) -> None:
        """Stop the threads (dropping queued writes), close the file, release the owners."""
        self._w.close()
        self._owners = []

    def __del__(self):
        # Join the threads before the owners of the memory they read can go away.
        w = getattr(self, "_w", None)
        if w is not None:
            w.close()

    def inject_fault(self, after_writes: int, err: int) -> None:
        """Tests: make the pwrite number ``after_writes`` (0-based) and later fail with ``err``."""
        self._w.inject_fault(after_writes, err)


def read_into(path: str, items, *, verify: bool = True, threads: int | None = None,
              direct: bool | None = None):
    """Read ``items`` [(file_offset, nbytes, dst_address, chunk_bytes, crcs)] of ``path``.

    Returns a ``_C.ReadResult``: ``err`` (0 or an errno), ``msg``, ``bad_item``, ``direct``
    (O_DIRECT used), ``mismatches`` [(item, chunk, crc32c found)] and ``truncated``
    [(item, file offset of the end of file)]; see ``csrc/reader.h``. An item the reader cannot
    take (chunk size 0, bytes beyond file offset 2**63 - 1, an address range that wraps, a
    checksum list of another length than its chunks when verifying) reads nothing at all:
    ``err`` EINVAL, ``bad_item`` and ``msg`` say which. Numbers outside uint64 raise TypeError.
    """
    threads = default_read_threads() if threads is None else int(threads)
    direct = default_direct() if direct is None else bool(direct)
    return _C.read_into(path, list(items), bool(verify), threads, direct)
