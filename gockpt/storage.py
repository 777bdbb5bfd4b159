"""On-disk checkpoint format: parallel writer, atomic commit, validated parallel reader.

A checkpoint is a directory ``<root>/<name>`` holding

* ``data.safetensors``: every tensor, in the safetensors layout (8-byte
  little-endian header length, JSON header padded with spaces, then the raw
  little-endian data, contiguous and without holes), so that
  ``safetensors.safe_open`` and other tools can read it. For O_DIRECT, the JSON
  header is padded so that the data region starts at a multiple of 4096, every
  tensor starts at a multiple of 4096, and the gap after each tensor is covered by
  a zero-filled U8 filler tensor ``__pad__/<n>`` (in the safetensors header, not in
  the manifest); the file size is a multiple of 4096.
* ``manifest.json``: ``{"format": "gockpt", "format_version": 2, "tensors":
  {name: {"file", "dtype", "shape", "offset", "nbytes", "block_bytes",
  "crc32c"}}, ...}`` plus the caller's own fields. ``offset`` is the absolute byte
  offset in ``file``; ``crc32c`` lists the crc32c (Castagnoli) of each
  ``block_bytes``-sized block of the tensor's bytes (the last one shorter), computed
  by the writer threads while the data passes.

``<root>/latest`` holds the name of the latest committed checkpoint.

Writing and reading run in C++ threads (``csrc/io.cpp`` via ``gockpt._io``): large
pwrites/preads at precomputed offsets, O_DIRECT where the file system accepts it
(else buffered + fsync, logged once), the GIL released.

Crash safety: everything is written into ``<root>/.tmp-<name>-<pid>-<random>``,
fsynced, and only then renamed to ``<root>/<name>``; ``latest`` is replaced with
``os.replace``. A crash at any point leaves either the previous state or the
new one, plus perhaps a ``.tmp-*`` entry that ``cleanup_temporaries`` removes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import mmap
import os
import re
import secrets
import shutil
import threading
import warnings

import torch

from gockpt import _io
from gockpt.errors import CheckpointNotFoundError, CorruptCheckpointError, LoadError, StorageError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DATA_FILE",
    "MANIFEST_FILE",
    "LATEST_FILE",
    "DTYPE_TO_CODE",
    "CODE_TO_DTYPE",
    "checkpoint_name",
    "CheckpointWriter",
    "resolve",
    "list_checkpoints",
    "read_manifest",
    "read_tensors",
    "cleanup_temporaries",
]

FORMAT = "gockpt"
FORMAT_VERSION = 2
DATA_FILE = "data.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"

# torch dtype <-> safetensors dtype code. The first ten are the ones gockpt
# promises; the rest are safetensors codes that cost nothing to support.
DTYPE_TO_CODE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_TO_CODE.items()}
_ITEMSIZE = {code: dtype.itemsize for dtype, code in DTYPE_TO_CODE.items()}

# Checksum granularity: each tensor's bytes are checksummed (crc32c) per block of this many
# bytes, so that a damaged byte is located to a block and the reader verifies in parallel.
BLOCK_BYTES = 4 << 20
# Every tensor starts at a multiple of ALIGN in data.safetensors (O_DIRECT needs it).
ALIGN = _io.ALIGN
# Names of the filler tensors that keep the safetensors data region free of holes.
PAD_PREFIX = "__pad__/"
# Tests: (n, errno) makes the n-th data pwrite (0-based) of the next writers fail.
_inject_fault = None

# .tmp-<name>-<pid>-<random>; <name> may itself contain '-', hence the greedy (.+).
_TMP_RE = re.compile(r"^\.tmp-(.+)-(\d+)-([0-9a-f]+)$")


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint of training step ``step``, e.g. ``step-000000120``.

    Zero-padded so that names sort in step order.
    """
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:09d}"


def _check_name(name: str, what: str = "checkpoint name") -> None:
    # A name is a single path component: it must not escape the root, hide
    # (names starting with '.' are reserved for temporaries) or shadow `latest`.
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or name == LATEST_FILE
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(f"invalid {what} {name!r}: use a plain file name such as 'step-000000120'")


def _fsync_dir(path: str) -> None:
    """fsync a directory, so that the entries created or renamed in it are durable."""
    if os.name == "nt":
        return  # Windows cannot open a directory as a file; its renames are journaled anyway
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    """os.write until all of ``data`` is written (os.write may write less)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _layout_file(items: list) -> tuple:
    """File layout of ``items`` [(name, code, shape, nbytes)] in safetensors form.

    Returns (header bytes incl. the 8-byte length, {name: absolute offset}, file size). The
    JSON header is padded with spaces so that the data region starts at a multiple of ALIGN;
    each tensor starts at a multiple of ALIGN, the gap after it is covered by a U8 filler
    tensor ``__pad__/<n>`` (safetensors wants the data region without holes), and the file
    ends on a multiple of ALIGN.
    """
    header: dict = {}
    rel: dict = {}
    pos = 0
    npad = 0
    for name, code, shape, nbytes in items:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        end = pos + nbytes
        gap = -end % ALIGN
        if gap:
            header[f"{PAD_PREFIX}{npad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [end, end + gap]}
            npad += 1
        pos = end + gap
    header["__metadata__"] = {"format": FORMAT}
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    data_start = _round_up(8 + len(head), ALIGN)
    head += b" " * (data_start - 8 - len(head))
    offsets = {name: data_start + r for name, r in rel.items()}
    return len(head).to_bytes(8, "little") + head, offsets, data_start + pos


class _Slot:
    __slots__ = ("index", "name", "dtype", "code", "shape", "numel", "itemsize", "nbytes", "offset")


def _check_tensor(name, t) -> None:
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
        _check_name(name)
        self.root = os.path.abspath(root)
        self.name = name
        self.threads = threads
        self.direct = direct
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        if type(self.block_bytes) is not int or self.block_bytes <= 0 or self.block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes!r}")
        self._entries: dict | None = None  # manifest "tensors", once finish() succeeded
        self._slots: dict | None = None  # name -> _Slot, once begin() succeeded
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
                _check_tensor(name, t)
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
            sl = _Slot()
            sl.index, sl.name, sl.dtype, sl.code, sl.shape = len(slots), name, dtype, DTYPE_TO_CODE[dtype], shape
            sl.numel = math.prod(shape)
            sl.itemsize = dtype.itemsize
            sl.nbytes = sl.numel * sl.itemsize
            slots[name] = sl
            items.append((name, sl.code, shape, sl.nbytes))
        head, offsets, total = _layout_file(items)
        for name, sl in slots.items():
            sl.offset = offsets[name]
        try:
            w = _io.Writer(self.data_path, total, head, [(sl.offset, sl.nbytes) for sl in slots.values()],
                           block_bytes=self.block_bytes, threads=self.threads, direct=self.direct)
            if _inject_fault is not None:
                w.inject_fault(*_inject_fault)
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
        _check_tensor(name, tensor)
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

        ``manifest`` must be plain JSON (encode Python state with ``gockpt.tree``)
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
                raise TypeError(f"manifest is not plain JSON ({e}); encode Python state with gockpt.tree.encode") from e
            # Written in place, not via a tmp file + rename: the whole directory is
            # still invisible, and the directory rename below is the atomic step.
            self._write_file(os.path.join(self.tmp_path, MANIFEST_FILE), text.encode("utf-8"))
            _fsync_dir(self.tmp_path)
            self._publish()
            self._done = True
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"committing checkpoint {self.final_path!r} failed: {e}") from e
            raise
        if update_latest:
            try:
                _write_latest(self.root, self.name)
            except OSError as e:
                raise StorageError(
                    f"checkpoint {self.final_path!r} was committed but updating {LATEST_FILE!r} failed: {e}"
                ) from e
        return self.final_path

    def _publish(self) -> None:
        """Rename the temporary directory to its final name, replacing an old checkpoint of that name."""
        final = self.final_path
        old = None
        if os.path.lexists(final):
            # No atomic directory swap in the stdlib: move the old one aside
            # (still a .tmp-* name, so cleanup_temporaries finds it after a crash).
            old = os.path.join(self.root, f"{TMP_PREFIX}{self.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(final, old)
        try:
            os.rename(self.tmp_path, final)
        except OSError:
            if old is not None:
                os.rename(old, final)  # put the previous checkpoint back
            raise
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _write_file(path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

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


def _write_latest(root: str, name: str) -> None:
    """Atomically make ``<root>/latest`` contain ``name``."""
    tmp = os.path.join(root, f"{TMP_PREFIX}{LATEST_FILE}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        CheckpointWriter._write_file(tmp, name.encode("utf-8"))
        os.replace(tmp, os.path.join(root, LATEST_FILE))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(root)


def _is_committed(path: str) -> bool:
    # manifest.json is written inside the temporary directory before the rename,
    # so a visible directory with a manifest is a committed checkpoint.
    return os.path.isfile(os.path.join(path, MANIFEST_FILE))


def list_checkpoints(root: str) -> list[str]:
    """Names of the committed checkpoints in ``root``, oldest first.

    Age is the modification time of ``manifest.json`` (written at commit), ties
    broken by name. Temporaries (``.tmp-*``) and other entries are ignored; a
    missing root gives an empty list.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(f"cannot list checkpoint directory {root!r}: {e}") from e
    found = []
    for name in names:
        if name.startswith(".") or name == LATEST_FILE:
            continue
        manifest = os.path.join(root, name, MANIFEST_FILE)
        try:
            found.append((os.stat(manifest).st_mtime_ns, name))
        except OSError:
            continue  # not a checkpoint directory
    return [name for _, name in sorted(found)]


def _describe_root(root: str) -> str:
    names = list_checkpoints(root)
    if not names:
        return f"{root!r} contains no committed checkpoint"
    shown = ", ".join(names[-10:])
    more = f" (and {len(names) - 10} older)" if len(names) > 10 else ""
    return f"{root!r} contains: {shown}{more}"


def resolve(root: str, tag: str | None = None) -> str:
    """Path of checkpoint ``tag`` in ``root``, or (tag None or "latest") of the one ``<root>/latest`` names.

    If ``latest`` is missing or names a checkpoint that does not exist, falls
    back to the newest committed checkpoint with a warning. Raises
    ``CheckpointNotFoundError`` saying what ``root`` contains if nothing fits.
    """
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint directory {root!r} does not exist")
    if tag == LATEST_FILE:
        tag = None
    if tag is not None:
        try:
            _check_name(tag, "checkpoint tag")
        except ValueError as e:
            raise CheckpointNotFoundError(str(e)) from None
        path = os.path.join(root, tag)
        if not _is_committed(path):
            raise CheckpointNotFoundError(f"no checkpoint {tag!r}: {_describe_root(root)}")
        return path

    latest_path = os.path.join(root, LATEST_FILE)
    try:
        with open(latest_path, encoding="utf-8") as f:
            latest = f.read().strip()
    except FileNotFoundError:
        latest = None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointNotFoundError(f"cannot read {latest_path!r}: {e}") from e
    if latest is not None:
        try:
            _check_name(latest)
            if _is_committed(os.path.join(root, latest)):
                return os.path.join(root, latest)
        except ValueError:
            pass
    names = list_checkpoints(root)
    if not names:
        raise CheckpointNotFoundError(f"no checkpoint to load: {_describe_root(root)}")
    why = "is missing" if latest is None else f"names {latest!r}, which is not a committed checkpoint"
    warnings.warn(
        f"{latest_path!r} {why}; using the newest committed checkpoint {names[-1]!r}",
        RuntimeWarning,
        stacklevel=2,
    )
    return os.path.join(root, names[-1])


def _is_plain_int(x) -> bool:
    return type(x) is int and x >= 0


def _check_checksums(e: dict) -> str | None:
    """What is wrong with the block_bytes / crc32c fields of entry ``e`` (None if fine)."""
    bb, crcs = e.get("block_bytes"), e.get("crc32c")
    if not (_is_plain_int(bb) and bb > 0 and bb % ALIGN == 0):
        return f"invalid block_bytes {bb!r} (a positive multiple of {ALIGN})"
    if not isinstance(crcs, list):
        return f"invalid crc32c {crcs!r:.60} (a list of block checksums)"
    nblocks = -(-e["nbytes"] // bb)
    if len(crcs) != nblocks:
        return f"crc32c lists {len(crcs)} block checksums, {e['nbytes']} bytes in blocks of {bb} need {nblocks}"
    if not all(_is_plain_int(c) and c < 2**32 for c in crcs):
        return "invalid crc32c: block checksums must be ints in [0, 2**32)"
    return None


def read_manifest(path: str) -> dict:
    """Read and validate ``<path>/manifest.json``.

    Checks the JSON, the format and version, and every tensor entry: the file
    is a plain name inside the checkpoint, the dtype is known, ``nbytes`` equals
    ``prod(shape) * itemsize`` and ``offset + nbytes`` lies within the file.
    Raises ``CheckpointNotFoundError`` if ``path`` is not a directory and
    ``CorruptCheckpointError`` naming the checkpoint, file and tensor otherwise.
    """
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint {path!r} does not exist")
    mpath = os.path.join(path, MANIFEST_FILE)

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {path!r}: {MANIFEST_FILE}: {msg}")

    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise bad("missing (the checkpoint was not committed completely)") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"unreadable or not JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if manifest.get("format") != FORMAT:
        raise bad(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    if not _is_plain_int(version):
        raise bad(f"invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise bad(f"format_version {version} is newer than this gockpt supports ({FORMAT_VERSION}); upgrade gockpt")
    if version < FORMAT_VERSION:
        raise bad(f"format_version {version} was written by an older, pre-release gockpt "
                  f"(per-tensor crc32, unaligned); this gockpt reads format_version {FORMAT_VERSION} only")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("'tensors' is missing or not an object")

    sizes: dict[str, int] = {}  # file -> size, each file stat()ed once
    for name, e in tensors.items():

        def bad_tensor(msg: str) -> CorruptCheckpointError:
            file = e.get("file") if isinstance(e, dict) else None
            return bad(f"tensor {name!r} (file {file!r}): {msg}")

        if not isinstance(e, dict):
            raise bad_tensor("entry is not an object")
        missing = {"file", "dtype", "shape", "offset", "nbytes", "block_bytes", "crc32c"} - set(e)
        if missing:
            raise bad_tensor(f"missing fields {sorted(missing)}")
        file = e["file"]
        if not isinstance(file, str) or file in ("", ".", "..") or any(c in file for c in "/\\\0"):
            raise bad_tensor("file must be a plain file name inside the checkpoint directory")
        if e["dtype"] not in _ITEMSIZE:
            raise bad_tensor(f"unknown dtype {e['dtype']!r}")
        shape = e["shape"]
        if not isinstance(shape, list) or not all(_is_plain_int(d) for d in shape):
            raise bad_tensor(f"invalid shape {shape!r}")
        if not (_is_plain_int(e["offset"]) and _is_plain_int(e["nbytes"])):
            raise bad_tensor(f"invalid offset {e['offset']!r} or nbytes {e['nbytes']!r}")
        expected = math.prod(shape) * _ITEMSIZE[e["dtype"]]  # Python ints: no overflow on absurd shapes
        if e["nbytes"] != expected:
            raise bad_tensor(f"nbytes {e['nbytes']} does not match shape {shape} of {e['dtype']} ({expected})")
        if file not in sizes:
            try:
                sizes[file] = os.stat(os.path.join(path, file)).st_size
            except OSError as err:
                raise bad_tensor(f"data file missing or unreadable: {err}") from err
        if e["offset"] + e["nbytes"] > sizes[file]:
            raise bad_tensor(
                f"bytes {e['offset']}..{e['offset'] + e['nbytes']} lie beyond the end of the file "
                f"({sizes[file]} bytes): the file is truncated"
            )
        problem = _check_checksums(e)
        if problem:
            raise bad_tensor(problem)
    return manifest


# Fresh tensors of at least this size are allocated page-aligned (anonymous mmap, advised to
# use transparent huge pages): O_DIRECT reads land in them without a bounce copy, and
# faulting in 2 MiB pages costs far less than 4 KiB ones.
_MMAP_MIN_BYTES = 1 << 20


def _empty_for_read(shape: list, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    if nbytes < _MMAP_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, _round_up(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape)


_libc = None
_LOW_BIT = bytes(i & 1 for i in range(256))
# Residency is sampled: per item, up to _RES_SAMPLES windows of _RES_WINDOW pages, evenly spread.
_RES_SAMPLES = 16
_RES_WINDOW = 16


def _cached_items(fpath: str, items: list):
    """For each read item (offset, nbytes, ...): whether most of its pages are in the page cache,
    from mincore(2) on a read-only mapping of the file (sampled windows; nothing is read or
    faulted in). None if it cannot be asked (no mincore, mmap refused). Note: Linux reports
    page-cache state only to a process that owns the file or may write it; for others every
    item counts as not cached.
    """
    global _libc
    if not hasattr(os, "posix_fadvise"):  # POSIX systems with mincore only
        return None
    page = mmap.PAGESIZE
    lo = min(it[0] for it in items) // page * page
    hi = max(it[0] + it[1] for it in items)
    length = hi - lo
    if length <= 0:
        return None
    try:
        if _libc is None:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.mincore.restype = ctypes.c_int
            _libc = lib
        fd = os.open(fpath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            vec = ctypes.create_string_buffer(_RES_WINDOW)
            out = []
            for it in items:
                first = (it[0] - lo) // page
                npages = -(-(it[0] + it[1] - lo) // page) - first
                nwin = min(_RES_SAMPLES, -(-npages // _RES_WINDOW))
                resident = total = 0
                for j in range(nwin):
                    p0 = first + (npages - _RES_WINDOW) * j // max(1, nwin - 1) if npages > _RES_WINDOW else first
                    n = min(_RES_WINDOW, npages)
                    if _libc.mincore(addr + p0 * page, n * page, vec) != 0:
                        return None
                    resident += vec.raw[:n].translate(_LOW_BIT).count(1)
                    total += n
                out.append(2 * resident >= total)
            return out
        finally:
            _libc.munmap(addr, length)
    except (OSError, AttributeError, ValueError):
        return None


def _split_by_residency(fpath: str, items: list) -> list:
    """Split read ``items`` into [(indices, direct)] groups: items mostly in the page cache are read
    buffered (a memcpy from the cache, where O_DIRECT would read the disk again), the others with
    O_DIRECT (no second copy through the cache). Cached group first; file order within each."""
    cached = _cached_items(fpath, items)
    if cached is None:
        return [(list(range(len(items))), True)]
    groups = ([i for i, c in enumerate(cached) if c], False), ([i for i, c in enumerate(cached) if not c], True)
    return [g for g in groups if g[0]]


def read_tensors(path: str, manifest: dict, names=None, *, verify: bool = True, out: dict | None = None,
                 threads: int | None = None, direct: bool | None = None) -> dict:
    """Read tensors of checkpoint ``path`` into CPU tensors, in parallel.

    ``manifest`` is what ``read_manifest(path)`` returned; ``names`` selects tensors
    (default: all). Tensors named in ``out`` (name -> CPU tensor of the stored dtype and
    shape) are read straight into those tensors (returned as the same objects); the others
    into new tensors. Every block's crc32c is checked unless ``verify=False``. Reads use
    ``threads`` threads (default: twice the cores / ``GOCKPT_IO_THREADS``). ``direct=None``
    (default): tensors whose bytes are mostly in the page cache (e.g. a restart right after the
    checkpoint was written, or a second read) are read buffered, the others with O_DIRECT;
    ``direct=True`` forces O_DIRECT, ``direct=False`` / ``GOCKPT_IO_DIRECT=0`` buffered reads.

    Raises ``CorruptCheckpointError`` naming the checkpoint, file and tensor (and the block) on
    a checksum mismatch, truncation, missing file or missing tensor; ``LoadError`` if an
    ``out`` tensor has another dtype or shape. After an error, the ``out`` tensors may hold
    partly read data.
    """
    entries = manifest["tensors"]
    names = list(entries) if names is None else list(names)
    out = {} if out is None else out
    by_file: dict[str, list] = {}
    for name in names:
        if name not in entries:
            raise CorruptCheckpointError(f"checkpoint {path!r} has no tensor {name!r}")
        by_file.setdefault(entries[name]["file"], []).append(name)

    result = {}
    for file, file_names in by_file.items():
        fpath = os.path.join(path, file)
        try:
            size = os.stat(fpath).st_size
        except OSError as e:
            raise CorruptCheckpointError(
                f"checkpoint {path!r}: cannot open {file!r} (needed for tensor {file_names[0]!r}): {e}"
            ) from e
        # In file order, so the reads are roughly sequential.
        file_names = sorted(file_names, key=lambda n: entries[n]["offset"])
        items, item_names, copy_back = [], [], []
        for name in file_names:
            e = entries[name]

            def bad(msg: str) -> CorruptCheckpointError:
                return CorruptCheckpointError(f"checkpoint {path!r}: file {fpath!r}: tensor {name!r}: {msg}")

            offset, nbytes = e["offset"], e["nbytes"]
            # Checked before allocating (the manifest may not have been validated), so
            # damaged numbers cannot make us allocate more than the file holds.
            if e["dtype"] not in CODE_TO_DTYPE or not isinstance(e["shape"], list) or \
                    not all(_is_plain_int(d) for d in e["shape"]):
                raise bad(f"invalid dtype {e['dtype']!r} or shape {e['shape']!r}")
            if not (_is_plain_int(offset) and _is_plain_int(nbytes)):
                raise bad(f"invalid offset {offset!r} or nbytes {nbytes!r}")
            if math.prod(e["shape"]) * _ITEMSIZE[e["dtype"]] != nbytes:
                raise bad(f"nbytes {nbytes} does not match shape {e['shape']} of {e['dtype']}")
            if offset + nbytes > size:
                raise bad(f"bytes {offset}..{offset + nbytes} lie outside the file ({size} bytes): truncated")
            problem = _check_checksums(e)
            if problem and verify:
                raise bad(problem)
            bb = e["block_bytes"] if not problem else BLOCK_BYTES
            dtype = CODE_TO_DTYPE[e["dtype"]]
            dst = out.get(name)
            if dst is not None:
                if not isinstance(dst, torch.Tensor) or dst.device.type != "cpu" or dst.layout != torch.strided:
                    raise LoadError(f"out[{name!r}] must be a dense CPU tensor, got {dst!r:.80}")
                if dst.dtype != dtype or list(dst.shape) != e["shape"]:
                    raise LoadError(f"checkpoint {path!r}: tensor {name!r} is {e['dtype']} {e['shape']}, "
                                    f"out[{name!r}] is {dst.dtype} {list(dst.shape)}")
                target = dst
                if not dst.is_contiguous():
                    target = torch.empty(e["shape"], dtype=dtype)
                    copy_back.append((dst, target))
            else:
                target = dst = _empty_for_read(e["shape"], dtype, nbytes)
            result[name] = dst
            if nbytes:
                items.append((offset, nbytes, target.data_ptr(), bb, list(e["crc32c"]) if verify else []))
                item_names.append(name)
        if items:
            if direct is None and _io.default_direct():
                groups = _split_by_residency(fpath, items)
            else:
                groups = [(list(range(len(items))), direct)]
            where = f"checkpoint {path!r}: file {fpath!r}"
            err = 0
            mismatches, truncated = [], []
            for idx, gdirect in groups:
                gerr, gmsg, gbad, _direct, gmis, gtrunc = _io.read_into(
                    fpath, [items[i] for i in idx], verify=verify, threads=threads, direct=gdirect)
                # Indices back to ``items``.
                truncated += [(idx[i], eof) for i, eof in gtrunc]
                mismatches += [(idx[i], k, got) for i, k, got in gmis]
                if gerr and not err:
                    err, msg, bad_item = gerr, gmsg, (idx[gbad] if gbad >= 0 else -1)
                if gerr or gtrunc:
                    break
            truncated.sort()
            mismatches.sort()
            if truncated:
                i, eof = truncated[0]
                raise CorruptCheckpointError(f"{where}: tensor {item_names[i]!r}: the file ended at byte {eof}: "
                                             "truncated")
            if err:
                tname = item_names[bad_item] if bad_item >= 0 else file_names[0]
                raise CorruptCheckpointError(f"{where}: tensor {tname!r}: {msg}") from OSError(err, msg)
            if mismatches:
                i, k, got = mismatches[0]
                off, n, _, bb, crcs = items[i]
                lo, hi = k * bb, min(n, (k + 1) * bb)
                more = f" ({len(mismatches) - 1} more damaged block(s))" if len(mismatches) > 1 else ""
                raise CorruptCheckpointError(
                    f"{where}: tensor {item_names[i]!r}: block {k} (bytes {lo}..{hi} of the tensor, "
                    f"file offset {off + lo}): checksum mismatch (crc32c {got:#010x}, expected "
                    f"{crcs[k]:#010x}): the data is corrupt{more}")
        for dst, tmp in copy_back:
            dst.copy_(tmp)
    return {name: result[name] for name in names}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OverflowError:
        return False
    return True


def cleanup_temporaries(root: str) -> list[str]:
    """Remove ``.tmp-*`` entries of ``root`` left behind by processes that are no longer alive.

    Entries of live processes (including this one) are kept. Returns the paths
    removed. Note: liveness is checked on this host only, so on a file system
    shared between machines call it only when no other machine is writing.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        m = _TMP_RE.match(name)
        if not m or _pid_alive(int(m.group(2))):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if not os.path.lexists(path):
            removed.append(path)
    return removed
