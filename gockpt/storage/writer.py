"""Writes one checkpoint: a pool of C++ threads fills ``data.safetensors`` (O_DIRECT where the
file system allows, checksums computed as the data passes); then the manifest is written and the
directory published atomically (:mod:`.commit`)."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import threading

import torch

from ..errors import StorageError
from . import io as _io
from .commit import publish, write_file, write_latest
from .format import (ALIGN, BLOCK_BYTES, DATA_FILE, DTYPE_TO_CODE, FORMAT, FORMAT_VERSION,
                     LATEST_FILE, MANIFEST_FILE, PAD_PREFIX, TMP_PREFIX, check_name, fsync_dir,
                     layout_file)


class _Region:
    __slots__ = ("index", "name", "dtype", "code", "shape", "numel", "itemsize", "nbytes", "offset")


def check_tensor(name, t) -> None:
    if not isinstance(name, str) or name == "__metadata__" or name.startswith(PAD_PREFIX):
        raise TypeError(f"tensor name {name!r} is not allowed: use a str other than '__metadata__' "
                        f"and not starting with {PAD_PREFIX!r}")
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
        raise TypeError(f"tensor {name!r}: expected a dense CPU torch.Tensor, got {t!r:.80}")
    if t.dtype not in DTYPE_TO_CODE:
        raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")


class CheckpointWriter:
    """Writes one checkpoint into a temporary directory and commits it atomically.

    Usage: ``w = CheckpointWriter(root, name); w.write_tensors(tensors);
    w.commit(manifest)``; call ``w.abort()`` to give up. After any failure the
    temporary directory is removed and the writer cannot be used any more.

    Streaming: ``w.begin({name: (dtype, shape)})`` fixes the layout and opens the file;
    ``w.write(name, tensor, start=0)`` queues a tensor, or a flat element range of it, from any
    thread, in any order; ``w.finish()`` waits for the writes, fsyncs and records the
    checksums; then ``w.commit(manifest)``. The bytes are written by ``threads`` C++ threads
    (default: the number of cores, or ``GOCKPT_IO_THREADS``) with O_DIRECT unless the file
    system refuses it or ``direct=False`` / ``GOCKPT_IO_DIRECT=0``.
    """

    def __init__(self, root: str, name: str, *, threads: int | None = None, direct: bool | None = None,
                 block_bytes: int | None = None):
        """Create ``root`` if missing and a fresh temporary directory in it.

        Raises ``StorageError`` if ``root`` cannot be created or written to, and
        ``ValueError`` if ``name`` is not a plain file name.
        """
        check_name(name)
        self.root = os.path.abspath(root)
        self.name = name
        self.threads = threads
        self.direct = direct
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        if type(self.block_bytes) is not int or self.block_bytes <= 0 or self.block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes!r}")
        self._entries: dict | None = None  # manifest "tensors", once finish() succeeded
        self._slots: dict | None = None  # name -> _Region, once begin() succeeded
        self._io = None  # the C++ writer between begin() and finish()
        self._lock = threading.Lock()
        self._total = 0
        self._done = False  # committed or aborted
        self.used_direct: bool | None = None  # whether O_DIRECT was used (after begin)
        try:
            os.makedirs(self.root, exist_ok=True)
            tmp = f"{TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
            self.tmp_path = os.path.join(self.root, tmp)
            os.mkdir(self.tmp_path)
        except OSError as e:
            raise StorageError(
                f"cannot write checkpoints to {self.root!r}: {e.strerror or e}. "
                "Pass a checkpoint directory that you can create and write to."
            ) from e

    @property
    def final_path(self) -> str:
        """Where the checkpoint will be after ``commit``."""
        return os.path.join(self.root, self.name)

    @property
    def data_path(self) -> str:
        return os.path.join(self.tmp_path, DATA_FILE)

    def _failed(self, e: BaseException, what: str):
        """Abort and return the exception to raise for failure ``e``."""
        self.abort()
        if isinstance(e, OSError) and not isinstance(e, StorageError):
            return StorageError(f"{what} {self.data_path} failed: {e}")
        return e

    # -------------------------------------------------------------- one call

    def write_tensors(self, tensors: dict) -> int:
        """Write ``tensors`` (name -> CPU tensor) to ``data.safetensors`` in the temporary directory.

        Equivalent to ``begin`` with their dtypes and shapes, ``write`` of each, ``finish``.
        Checksums every block while writing (no re-read), fsyncs the file and returns its
        size in bytes. Can be called once per writer, also from a background thread. Raises
        ``TypeError`` for a value that is not a CPU tensor of a supported dtype,
        ``StorageError`` if the write fails; in both cases the temporary directory is removed.
        """
        self._check_usable()
        if self._slots is not None:
            # Misuse, not a failed write: leave the writer (and its data) alone.
            raise StorageError(f"write_tensors was already called for checkpoint {self.name!r}")
        try:
            for name, t in tensors.items():
                check_tensor(name, t)
            self.begin({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})
            for name, t in tensors.items():
                self.write(name, t)
            return self.finish()
        except BaseException as e:
            err = self._failed(e, "writing")
            if err is e:
                raise
            raise err from e

    # -------------------------------------------------------------- streaming

    def begin(self, layout: dict) -> None:
        """Fix the tensors of this checkpoint: ``layout`` maps name -> (torch dtype, shape).

        Computes the file layout, creates ``data.safetensors`` (its size reserved, header
        written) and starts the writer threads. Raises ``TypeError``/``ValueError`` for a
        bad layout (the writer stays usable), ``StorageError`` if the file cannot be created
        (the temporary directory is then removed).
        """
        self._check_usable()
        if self._slots is not None:
            raise StorageError(f"begin/write_tensors was already called for checkpoint {self.name!r}")
        slots: dict = {}
        items = []
        for name, spec in layout.items():
            if not isinstance(name, str) or name == "__metadata__" or name.startswith(PAD_PREFIX):
                raise TypeError(f"tensor name {name!r} is not allowed: use a str other than "
                                f"'__metadata__' and not starting with {PAD_PREFIX!r}")
            try:
                dtype, shape = spec
                shape = [int(d) if isinstance(d, int) and not isinstance(d, bool) else None for d in shape]
            except (TypeError, ValueError):
                raise TypeError(f"tensor {name!r}: layout must be (dtype, shape), got {spec!r:.80}") from None
            if dtype not in DTYPE_TO_CODE:
                raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored")
            if any(d is None or d < 0 for d in shape):
                raise ValueError(f"tensor {name!r}: invalid shape {spec[1]!r}")
            sl = _Region()
            sl.index, sl.name, sl.dtype, sl.code, sl.shape = len(slots), name, dtype, DTYPE_TO_CODE[dtype], shape
            sl.numel = math.prod(shape)
            sl.itemsize = dtype.itemsize
            sl.nbytes = sl.numel * sl.itemsize
            slots[name] = sl
            items.append((name, sl.code, shape, sl.nbytes))
        head, offsets, total = layout_file(items)
        for name, sl in slots.items():
            sl.offset = offsets[name]
        try:
            w = _io.Writer(self.data_path, total, head, [(sl.offset, sl.nbytes) for sl in slots.values()],
                           block_bytes=self.block_bytes, threads=self.threads, direct=self.direct)
        except BaseException as e:
            err = self._failed(e, "creating")
            if err is e:
                raise
            raise err from e
        self._io, self._slots, self._total, self.used_direct = w, slots, total, w.direct

    def write(self, name: str, tensor: torch.Tensor, *, start: int = 0) -> None:
        """Queue ``tensor`` as the value of ``name`` (or, with ``start``, of its flat elements
        ``[start, start + tensor.numel())``); returns once queued.

        Thread-safe; any order; every element of every tensor must be written exactly once
        before ``finish``. ``tensor`` must have the layout's dtype and either its shape or
        (for a range) be 1-D. Its memory must not change until ``finish`` returns (a
        non-contiguous tensor is copied first). Raises ``TypeError``/``ValueError`` on misuse
        without aborting.
        """
        self._check_usable()
        if self._io is None:
            raise StorageError(f"write() of checkpoint {self.name!r} needs begin() first (or was finished)")
        sl = self._slots.get(name) if isinstance(name, str) else None
        if sl is None:
            raise ValueError(f"tensor {name!r} is not in the layout given to begin()")
        check_tensor(name, tensor)
        if tensor.dtype != sl.dtype:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype}, the layout says {sl.dtype}")
        if type(start) is not int or start < 0 or start + tensor.numel() > sl.numel:
            raise ValueError(f"tensor {name!r}: elements [{start}, {start}+{tensor.numel()}) "
                             f"outside its {sl.numel} elements")
        if list(tensor.shape) != sl.shape and tensor.dim() != 1:
            raise ValueError(f"tensor {name!r}: shape {list(tensor.shape)}, the layout says {sl.shape} "
                             "(write a range as a 1-D tensor)")
        # resolve_*: a lazily conjugated/negated view has other bytes in memory than its
        # value; these are no-ops (no copy) for ordinary tensors.
        t = tensor.detach().resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        n = t.numel() * sl.itemsize
        if n == 0:
            return
        with self._lock:
            if self._io is None:
                raise StorageError(f"the writer of checkpoint {self.name!r} was already finished")
            self._io.submit(sl.index, t.data_ptr(), start * sl.itemsize, n, owner=t)

    def finish(self) -> int:
        """Wait for every queued write, fsync ``data.safetensors`` and record the checksums.

        Returns the file size. Raises ``StorageError`` if a write failed or a tensor was not
        written completely (or some bytes twice); the temporary directory is then removed.
        """
        self._check_usable()
        if self._io is None:
            raise StorageError(f"finish() of checkpoint {self.name!r} needs begin() first (or was finished)")
        try:
            err, msg, bad, bad_off, crcs = self._io.finish()
            with self._lock:
                self._io.close()
                self._io = None
            if err > 0:
                raise OSError(err, msg)
            if err < 0:
                if bad >= 0:
                    sl = list(self._slots.values())[bad]
                    raise StorageError(f"checkpoint {self.name!r}: tensor {sl.name!r}: {msg} "
                                       f"(first at byte {bad_off} of {sl.nbytes})")
                raise StorageError(f"checkpoint {self.name!r}: {msg}")
            entries = {}
            for sl in self._slots.values():
                entries[sl.name] = {
                    "file": DATA_FILE,
                    "dtype": sl.code,
                    "shape": list(sl.shape),
                    "offset": sl.offset,
                    "nbytes": sl.nbytes,
                    "block_bytes": self.block_bytes,
                    "crc32c": list(crcs[sl.index]),
                }
        except BaseException as e:
            err = self._failed(e, "writing")
            if err is e:
                raise
            raise err from e
        self._entries = entries
        return self._total

    def commit(self, manifest: dict, *, update_latest: bool = True) -> str:
        """Write ``manifest.json`` and atomically publish the checkpoint as ``<root>/<name>``.

        ``manifest`` must be plain JSON (encode Python state with ``gockpt.storage.tree``)
        and must not use the keys ``format``, ``format_version`` or ``tensors``,
        which commit adds. An existing ``<root>/<name>`` is replaced only once
        the new one is complete. With ``update_latest`` (default), ``<root>/latest``
        is then atomically made to name this checkpoint. Returns the final path.
        Raises ``StorageError`` if a write or rename fails; the temporary
        directory is removed on any failure.
        """
        try:
            self._check_usable()
            reserved = {"format", "format_version", "tensors"} & set(manifest)
            if reserved:
                raise ValueError(f"manifest keys {sorted(reserved)} are reserved for gockpt")
            if self._slots is None:
                self.write_tensors({})  # a checkpoint without tensors still gets a (tiny) data file
            elif self._entries is None:
                self.finish()
            full = {"format": FORMAT, "format_version": FORMAT_VERSION, "tensors": self._entries, **manifest}
            try:
                text = json.dumps(full, indent=1, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise TypeError(f"manifest is not plain JSON ({e}); encode Python state with gockpt.storage.tree.encode") from e
            # Written in place, not via a tmp file + rename: the whole directory is
            # still invisible, and the directory rename below is the atomic step.
            write_file(os.path.join(self.tmp_path, MANIFEST_FILE), text.encode("utf-8"))
            fsync_dir(self.tmp_path)
            publish(self.root, self.tmp_path, self.name)
            self._done = True
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"committing checkpoint {self.final_path!r} failed: {e}") from e
            raise
        if update_latest:
            try:
                write_latest(self.root, self.name)
            except OSError as e:
                raise StorageError(
                    f"checkpoint {self.final_path!r} was committed but updating {LATEST_FILE!r} failed: {e}"
                ) from e
        return self.final_path

    def _check_usable(self) -> None:
        if self._done or not os.path.isdir(self.tmp_path):
            raise StorageError(f"the writer of checkpoint {self.name!r} was already committed or aborted")

    def abort(self) -> None:
        """Stop the writer threads and remove the temporary directory.

        Idempotent; does nothing after a successful commit.
        """
        if not self._done:
            self._done = True
            with self._lock:
                io, self._io = self._io, None
                if io is not None:
                    io.close()  # joins the threads before the written tensors may be freed
            shutil.rmtree(self.tmp_path, ignore_errors=True)

