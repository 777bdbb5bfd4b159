"""Writes one checkpoint: a pool of C++ threads fills ``data.safetensors`` (O_DIRECT where the
file system allows, checksums computed per chunk as the data passes); then the manifest is
written and the directory published atomically (:mod:`.commit`). Owns :class:`CheckpointWriter`,
the storage plugin interface (``Config.storage_writer``)."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import threading

import torch

from ..core.errors import StorageError
from ..core.paths import real_directory
from . import io as _io
from .commit import publish, write_file, write_latest
from .format import (ALIGN, CHUNK_BYTES, DATA_FILE, DTYPE_TO_CODE, FORMAT, FORMAT_VERSION, LATEST_FILE,
                     MANIFEST_FILE, PAD_PREFIX, SEAL_KEY, TMP_PREFIX, check_name, fsync_dir, layout_file,
                     manifest_seal, seal_manifest, tensor_entry)


class _Region:
    """Where one tensor of the layout goes in ``data.safetensors``."""

    __slots__ = ("index", "name", "dtype", "code", "shape", "numel", "itemsize", "nbytes", "offset")


def check_tensor_name(name) -> None:
    """Raise ``TypeError`` unless ``name`` may name a stored tensor."""
    if not isinstance(name, str) or name == "__metadata__" or name.startswith(PAD_PREFIX):
        raise TypeError(f"tensor name {name!r} is not allowed: use a str other than '__metadata__' "
                        f"and not starting with {PAD_PREFIX!r}")


def check_tensor(name, t) -> None:
    """Raise ``TypeError`` unless ``t`` is a dense CPU tensor of a storable dtype under an
    allowed ``name``."""
    check_tensor_name(name)
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
        raise TypeError(f"tensor {name!r}: expected a dense CPU torch.Tensor, got {t!r:.80}")
    if t.dtype not in DTYPE_TO_CODE:
        raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")


def plan_regions(layout: dict) -> dict:
    """name -> :class:`_Region` (without offset) for ``layout`` {name: (torch dtype, shape)}.

    Raises ``TypeError``/``ValueError`` for a bad name, dtype or shape.
    """
    regions: dict = {}
    for name, spec in layout.items():
        check_tensor_name(name)
        try:
            dtype, shape = spec
            shape = [int(d) if isinstance(d, int) and not isinstance(d, bool) else None for d in shape]
        except (TypeError, ValueError):
            raise TypeError(f"tensor {name!r}: layout must be (dtype, shape), got {spec!r:.80}") from None
        if dtype not in DTYPE_TO_CODE:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored")
        if any(d is None or d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: invalid shape {spec[1]!r}")
        r = _Region()
        r.index, r.name, r.dtype, r.code, r.shape = len(regions), name, dtype, DTYPE_TO_CODE[dtype], shape
        r.numel = math.prod(shape)
        r.itemsize = dtype.itemsize
        r.nbytes = r.numel * r.itemsize
        regions[name] = r
    return regions


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
    system refuses it or ``direct=False`` / ``GOCKPT_IO_DIRECT=0``, and checksummed per chunk
    of ``chunk_bytes`` (default 4 MiB).
    """

    def __init__(self, root: str, name: str, *, threads: int | None = None, direct: bool | None = None,
                 chunk_bytes: int | None = None):
        """Create ``root`` if missing and a fresh temporary directory in it.

        Raises ``StorageError`` if ``root`` cannot be created or written to, and
        ``ValueError`` if ``name`` is not a plain file name or ``chunk_bytes`` not a positive
        multiple of 4096.
        """
        check_name(name)
        try:  # the kernel's rule, as everywhere (gockpt.core.paths)
            self.root = real_directory(root)
        except OSError as e:
            raise StorageError(f"cannot create checkpoint root {os.fspath(root)!r}: {e.strerror}") from e
        self.name = name
        self.threads = threads
        self.direct = direct
        self.chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        if type(self.chunk_bytes) is not int or self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes!r}")
        self._entries: dict | None = None  # manifest "tensors", once finish() succeeded
        self._slots: dict | None = None  # name -> _Region, once begin() succeeded
        self._data_writer = None  # the C++ writer of data.safetensors between begin() and finish()
        self._lock = threading.Lock()
        self._total = 0
        self._done = False  # committed or aborted
        self._seal: str | None = None  # the manifest's seal, once written
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
        """``data.safetensors`` in the temporary directory."""
        return os.path.join(self.tmp_path, DATA_FILE)

    @contextlib.contextmanager
    def _abort_on_failure(self, doing: str):
        """Abort on any exception; an ``OSError`` becomes ``StorageError("<doing> failed: ...")``."""
        try:
            yield
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"{doing} failed: {e}") from e
            raise

    # -------------------------------------------------------------- one call

    def write_tensors(self, tensors: dict) -> int:
        """Write ``tensors`` (name -> CPU tensor) to ``data.safetensors`` in the temporary directory.

        Equivalent to ``begin`` with their dtypes and shapes, ``write`` of each, ``finish``.
        Checksums every chunk while writing (no re-read), fsyncs the file and returns its
        size in bytes. Can be called once per writer, also from a background thread. Raises
        ``TypeError`` for a value that is not a CPU tensor of a supported dtype,
        ``StorageError`` if the write fails; in both cases the temporary directory is removed.
        """
        self._check_usable()
        if self._slots is not None:
            # Misuse, not a failed write: leave the writer (and its data) alone.
            raise StorageError(f"write_tensors was already called for checkpoint {self.name!r}")
        with self._abort_on_failure(f"writing {self.data_path}"):
            for name, t in tensors.items():
                check_tensor(name, t)
            self.begin({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})
            for name, t in tensors.items():
                self.write(name, t)
            return self.finish()

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
        slots = plan_regions(layout)
        head, offsets, total = layout_file([(r.name, r.code, r.shape, r.nbytes) for r in slots.values()])
        for name, r in slots.items():
            r.offset = offsets[name]
        with self._abort_on_failure(f"creating {self.data_path}"):
            w = _io.Writer(self.data_path, total, head, [(r.offset, r.nbytes) for r in slots.values()],
                           chunk_bytes=self.chunk_bytes, threads=self.threads, direct=self.direct)
        self._data_writer, self._slots, self._total, self.used_direct = w, slots, total, w.direct

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
        if self._data_writer is None:
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
            if self._data_writer is None:
                raise StorageError(f"the writer of checkpoint {self.name!r} was already finished")
            self._data_writer.submit(sl.index, t.data_ptr(), start * sl.itemsize, n, owner=t)

    def finish(self) -> int:
        """Wait for every queued write, fsync ``data.safetensors`` and record the checksums.

        Returns the file size. Raises ``StorageError`` if a write failed or a tensor was not
        written completely (or some bytes twice); the temporary directory is then removed.
        """
        self._check_usable()
        if self._data_writer is None:
            raise StorageError(f"finish() of checkpoint {self.name!r} needs begin() first (or was finished)")
        with self._abort_on_failure(f"writing {self.data_path}"):
            res = self._data_writer.finish()
            with self._lock:
                self._data_writer.close()
                self._data_writer = None
            self._raise_for(res)
            crcs = res.crcs  # converted to lists on each access: once
            entries = {r.name: tensor_entry(DATA_FILE, r.code, r.shape, r.offset, r.nbytes, self.chunk_bytes,
                                            crcs[r.index])
                       for r in self._slots.values()}
        self._entries = entries
        return self._total

    def _raise_for(self, res) -> None:
        """Raise for a failed ``_C.FinishResult``: ``OSError`` for an errno, ``StorageError`` naming
        the tensor for bytes not written exactly once."""
        if res.err > 0:
            raise OSError(res.err, res.msg)
        if res.err < 0:
            if res.bad_tensor >= 0:
                sl = list(self._slots.values())[res.bad_tensor]
                raise StorageError(f"checkpoint {self.name!r}: tensor {sl.name!r}: {res.msg} "
                                   f"(first at byte {res.bad_offset} of {sl.nbytes})")
            raise StorageError(f"checkpoint {self.name!r}: {res.msg}")

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
        with self._abort_on_failure(f"committing checkpoint {self.final_path!r}"):
            self._check_usable()
            reserved = {"format", "format_version", "tensors", SEAL_KEY} & set(manifest)
            if reserved:
                raise ValueError(f"manifest keys {sorted(reserved)} are reserved for gockpt")
            if self._slots is None:
                self.write_tensors({})  # a checkpoint without tensors still gets a (tiny) data file
            elif self._entries is None:
                self.finish()
            self._write_manifest(manifest)
            publish(self.root, self.tmp_path, self.name)
            self._done = True
        if update_latest:
            try:
                write_latest(self.root, self.name, self._seal)
            except OSError as e:
                raise StorageError(
                    f"checkpoint {self.final_path!r} was committed but updating {LATEST_FILE!r} failed: {e}"
                ) from e
        return self.final_path

    def _write_manifest(self, manifest: dict) -> None:
        """``manifest.json`` (the format fields, the tensor entries, ``manifest``) in the
        temporary directory, fsynced."""
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, "tensors": self._entries, **manifest}
        try:
            data = seal_manifest(full)
        except (TypeError, ValueError) as e:
            raise TypeError(f"manifest is not plain JSON ({e}); encode Python state with gockpt.storage.tree.encode") from e
        # Written in place, not via a tmp file + rename: the whole directory is
        # still invisible, and the directory rename in publish() is the atomic step.
        write_file(os.path.join(self.tmp_path, MANIFEST_FILE), data)
        fsync_dir(self.tmp_path)
        self._seal = manifest_seal(data)

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
                data_writer, self._data_writer = self._data_writer, None
                if data_writer is not None:
                    data_writer.close()  # joins the threads before the written tensors may be freed
            shutil.rmtree(self.tmp_path, ignore_errors=True)
