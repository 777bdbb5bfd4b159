"""On-disk checkpoint format: writer, atomic commit, validated reader.

A checkpoint is a directory ``<root>/<name>`` holding

* ``data.safetensors``: every tensor, in the safetensors layout (8-byte
  little-endian header length, JSON header padded with spaces to a multiple of 8,
  then the raw little-endian data, contiguous and without holes), so that
  ``safetensors.safe_open`` and other tools can read it;
* ``manifest.json``: ``{"format": "gockpt", "format_version": 1, "tensors":
  {name: {"file", "dtype", "shape", "offset", "nbytes", "crc32"}}, ...}`` plus
  the caller's own fields. ``offset`` is the absolute byte offset in ``file``.

``<root>/latest`` holds the name of the latest committed checkpoint.

Crash safety: everything is written into ``<root>/.tmp-<name>-<pid>-<random>``,
fsynced, and only then renamed to ``<root>/<name>``; ``latest`` is replaced with
``os.replace``. A crash at any point leaves either the previous state or the
new one, plus perhaps a ``.tmp-*`` entry that ``cleanup_temporaries`` removes.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import warnings
import zlib

import torch

from gockpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError

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
FORMAT_VERSION = 1
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

# Large enough that syscall and crc32 call overhead vanish, small enough that a
# non-contiguous tensor is copied only piecewise.
CHUNK_BYTES = 16 << 20

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


def _byte_chunks(t: torch.Tensor):
    """Yield the bytes of CPU tensor ``t`` in C order, as memoryviews of at most about CHUNK_BYTES.

    Contiguous tensors are not copied: the views point into the tensor's memory.
    A non-contiguous tensor is copied one slab of rows at a time, never whole.
    """
    if t.is_contiguous():
        # uint8 view: works for every dtype, including bf16 which numpy lacks.
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for i in range(0, len(raw), CHUNK_BYTES):
            yield raw[i : i + CHUNK_BYTES]
        return
    row_bytes = max(1, t[0].numel() * t.element_size()) if t.shape[0] else 1
    rows = max(1, CHUNK_BYTES // row_bytes)
    for i in range(0, t.shape[0], rows):
        yield from _byte_chunks(t[i : i + rows].contiguous())


class CheckpointWriter:
    """Writes one checkpoint into a temporary directory and commits it atomically.

    Usage: ``w = CheckpointWriter(root, name); w.write_tensors(tensors);
    w.commit(manifest)``; call ``w.abort()`` to give up. After any failure the
    temporary directory is removed and the writer cannot be used any more.
    """

    def __init__(self, root: str, name: str):
        """Create ``root`` if missing and a fresh temporary directory in it.

        Raises ``StorageError`` if ``root`` cannot be created or written to, and
        ``ValueError`` if ``name`` is not a plain file name.
        """
        _check_name(name)
        self.root = os.path.abspath(root)
        self.name = name
        self._entries: dict | None = None  # manifest "tensors", once write_tensors succeeded
        self._done = False  # committed or aborted
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

    def write_tensors(self, tensors: dict) -> int:
        """Write ``tensors`` (name -> CPU tensor) to ``data.safetensors`` in the temporary directory.

        Computes the crc32 of every tensor while writing it (no re-read), fsyncs
        the file and returns the number of bytes written. Can be called once per
        writer, also from a background thread. Raises ``TypeError`` for a value
        that is not a CPU tensor of a supported dtype, ``StorageError`` if the
        write fails; in both cases the temporary directory is removed.
        """
        self._check_usable()
        if self._entries is not None:
            # Misuse, not a failed write: leave the writer (and its data) alone.
            raise StorageError(f"write_tensors was already called for checkpoint {self.name!r}")
        try:
            return self._write_tensors(tensors)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"writing {os.path.join(self.tmp_path, DATA_FILE)} failed: {e}") from e
            raise

    def _write_tensors(self, tensors: dict) -> int:
        header: dict = {}
        begin = 0
        items = []
        for name, t in tensors.items():
            if not isinstance(name, str) or name == "__metadata__":
                raise TypeError(f"tensor name {name!r} is not allowed: use a str other than '__metadata__'")
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
                raise TypeError(f"tensor {name!r}: expected a dense CPU torch.Tensor, got {t!r:.80}")
            if t.dtype not in DTYPE_TO_CODE:
                raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
            # resolve_*: a lazily conjugated/negated view has other bytes in memory
            # than its value; these are no-ops (no copy) for ordinary tensors.
            t = t.detach().resolve_conj().resolve_neg()
            nbytes = t.numel() * t.element_size()
            code = DTYPE_TO_CODE[t.dtype]
            header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [begin, begin + nbytes]}
            items.append((name, t, code, begin, nbytes))
            begin += nbytes
        header["__metadata__"] = {"format": FORMAT}
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors expects
        data_start = 8 + len(head)
        total = data_start + begin

        entries = {}
        path = os.path.join(self.tmp_path, DATA_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, len(head).to_bytes(8, "little") + head)
            for name, t, code, rel, nbytes in items:
                crc = 0
                for chunk in _byte_chunks(t):
                    crc = zlib.crc32(chunk, crc)  # releases the GIL for large buffers
                    _write_all(fd, chunk)
                entries[name] = {
                    "file": DATA_FILE,
                    "dtype": code,
                    "shape": list(t.shape),
                    "offset": data_start + rel,
                    "nbytes": nbytes,
                    "crc32": crc,
                }
            os.fsync(fd)
        finally:
            os.close(fd)
        self._entries = entries
        return total

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
            if self._entries is None:
                self._write_tensors({})  # a checkpoint without tensors still gets a (tiny) data file
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
        """Remove the temporary directory. Idempotent; does nothing after a successful commit."""
        if not self._done:
            self._done = True
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
        missing = {"file", "dtype", "shape", "offset", "nbytes", "crc32"} - set(e)
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
        if not (_is_plain_int(e["crc32"]) and e["crc32"] < 2**32):
            raise bad_tensor(f"invalid crc32 {e['crc32']!r}")
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
    return manifest


def read_tensors(path: str, manifest: dict, names=None, *, verify: bool = True) -> dict:
    """Read tensors of checkpoint ``path`` into new CPU tensors.

    ``manifest`` is what ``read_manifest(path)`` returned; ``names`` selects
    tensors (default: all). The crc32 of each tensor is checked unless
    ``verify=False``. Raises ``CorruptCheckpointError`` naming the file and
    tensor on a checksum mismatch, truncation, missing file or missing tensor.
    """
    entries = manifest["tensors"]
    names = list(entries) if names is None else list(names)
    by_file: dict[str, list] = {}
    for name in names:
        if name not in entries:
            raise CorruptCheckpointError(f"checkpoint {path!r} has no tensor {name!r}")
        by_file.setdefault(entries[name]["file"], []).append(name)

    out = {}
    for file, file_names in by_file.items():
        fpath = os.path.join(path, file)
        try:
            f = open(fpath, "rb", buffering=0)
        except OSError as e:
            raise CorruptCheckpointError(
                f"checkpoint {path!r}: cannot open {file!r} (needed for tensor {file_names[0]!r}): {e}"
            ) from e
        with f:
            size = os.fstat(f.fileno()).st_size
            # In file order, so the reads are sequential.
            for name in sorted(file_names, key=lambda n: entries[n]["offset"]):
                out[name] = _read_one(f, size, fpath, name, entries[name], verify)
    return {name: out[name] for name in names}


def _read_one(f, size: int, fpath: str, name: str, e: dict, verify: bool) -> torch.Tensor:
    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{fpath!r}: tensor {name!r}: {msg}")

    offset, nbytes = e["offset"], e["nbytes"]
    # Checked before allocating (the manifest may not have been validated), so
    # damaged numbers cannot make us allocate more than the file holds.
    if math.prod(e["shape"]) * _ITEMSIZE[e["dtype"]] != nbytes:
        raise bad(f"nbytes {nbytes} does not match shape {e['shape']} of {e['dtype']}")
    if offset < 0 or offset + nbytes > size:
        raise bad(f"bytes {offset}..{offset + nbytes} lie outside the file ({size} bytes): truncated")
    t = torch.empty(e["shape"], dtype=CODE_TO_DTYPE[e["dtype"]])
    buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    f.seek(offset)
    crc = 0
    pos = 0
    while pos < nbytes:
        n = f.readinto(buf[pos : pos + CHUNK_BYTES])
        if not n:
            raise bad(f"file ended after {offset + pos} bytes: truncated")
        if verify:
            crc = zlib.crc32(buf[pos : pos + n], crc)
        pos += n
    if verify and crc != e["crc32"]:
        raise bad(f"checksum mismatch (crc32 {crc:#010x}, expected {e['crc32']:#010x}): the data is corrupt")
    return t


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
