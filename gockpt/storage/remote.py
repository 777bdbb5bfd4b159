"""Object storage (S3 and S3-compatible stores) as a place checkpoints live: ``s3://bucket/prefix``
URLs, the connection options, and the few operations the replicator and the readers need --
objects put whole (multipart, bounded memory, each part's MD5 checked against the store's
ETag), small objects read whole, byte ranges read in parallel straight into memory with
every checksum chunk verified, listings and deletions.

The client is ``obstore`` (Rust's ``object_store``; its synchronous calls release the GIL, so
a pool of Python threads keeps many requests in flight). A checkpoint in the store has the
same names as on disk: ``<prefix>/<checkpoint>/manifest.json``, ``.../data.safetensors``,
``.../rank-00001/...`` and ``<prefix>/latest``; a path string ``s3://bucket/prefix/step-N``
names it as a directory path names a local one (:func:`is_remote` tells them apart). How a
bucket is reached (credentials, region, endpoint) is :mod:`.remote_config`'s."""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from ..core.errors import ConfigError, StorageError
from ..core.remote_options import RemoteOptions
from ..core.paths import REMOTE_SCHEME as SCHEME, split_remote
from . import io as _io
from .remote_config import describe, storage_error, store_config


def split(url: str) -> tuple:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; ``ConfigError`` for a malformed URL."""
    try:
        return split_remote(url)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class Bucket:
    """One bucket of an S3-compatible store, reached with ``options``; keys are full paths in
    the bucket. Thread-safe (obstore's store is)."""

    def __init__(self, bucket: str, options: RemoteOptions):
        try:
            from obstore.store import S3Store
        except ImportError as e:
            raise ConfigError("object storage needs the obstore package: pip install obstore") from e
        self.name = bucket
        self.options = options
        kw = store_config(bucket, options)
        try:
            self.store = S3Store(bucket, config=kw["config"], client_options=kw["client_options"],
                                 retry_config=kw["retry_config"])
        except Exception as e:  # obstore raises its own error types for bad settings
            raise ConfigError(f"cannot set up the client of s3://{bucket}: {e}") from e
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()

    def where(self, key: str) -> str:
        return f"{SCHEME}{self.name}/{key}"

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.concurrency,
                                                thread_name_prefix=f"gockpt-s3-{self.name}")
            return self._pool

    # ---------------------------------------------------------------- small objects

    def head(self, key: str) -> Optional[dict]:
        """``{"size", "e_tag", "last_modified"}`` of object ``key``, or None if there is none."""
        import obstore
        try:
            meta = obstore.head(self.store, key)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise storage_error(f"cannot look up {self.where(key)}", e) from e
        return {"size": int(meta["size"]), "e_tag": meta.get("e_tag"),
                "last_modified": meta.get("last_modified")}

    def get_small(self, key: str, limit: int) -> bytes:
        """The bytes of object ``key`` (at most ``limit``): FileNotFoundError if there is none,
        ValueError if it is larger, StorageError if the store fails."""
        import obstore
        try:
            result = obstore.get(self.store, key)
            size = int(result.meta["size"])
            if size > limit:
                raise ValueError(f"{self.where(key)} is {size} bytes, more than the {limit} a "
                                 "valid one can be")
            return bytes(result.bytes())
        except (FileNotFoundError, ValueError):
            raise
        except Exception as e:
            raise storage_error(f"cannot read {self.where(key)}", e) from e

    def put_bytes(self, key: str, data: bytes) -> str:
        """Put ``data`` as object ``key`` in one request, checked by its ETag (the MD5 of the
        bytes)."""
        import obstore
        try:
            res = obstore.put(self.store, key, data, use_multipart=False)
        except Exception as e:
            raise storage_error(f"cannot upload {self.where(key)}", e) from e
        _check_etag(self.where(key), res.get("e_tag"), [hashlib.md5(data).digest()], True)
        return res.get("e_tag")

    # ---------------------------------------------------------------- files

    def put_file(self, key: str, path: str, *, check=None, gate=None) -> int:
        """Upload the local file ``path`` as object ``key`` in parts of ``part_bytes``
        (``concurrency`` in flight: memory is bounded), each part's MD5 computed as it is read
        and the store's ETag checked against them. ``check(offset, view)`` sees every byte read
        (in order) and raises to stop the upload before anything is completed -- the caller's
        checksums of the local bytes. ``gate()`` is called before each part is read (it may
        wait: the upload pauses). Returns the bytes uploaded."""
        import obstore
        size = os.path.getsize(path)
        parts = _Parts(path, self.options.part_bytes, check, gate)
        try:
            if size <= parts.part:  # one request: the ETag is the MD5 of the whole
                data = parts.whole()
                self.put_bytes(key, data)
                return len(data)
            res = obstore.put(self.store, key, iter(parts), chunk_size=parts.part,
                              max_concurrency=self.options.concurrency)
        except StorageError:
            raise
        except Exception as e:
            if parts.refused:  # the caller's check or gate stopped it
                raise parts.refused[0] from None
            raise storage_error(f"cannot upload {path!r} to {self.where(key)}", e) from e
        _check_etag(self.where(key), res.get("e_tag"), parts.digests, single=False)
        if parts.total != size:
            raise StorageError(f"{path!r} changed size while it was uploaded to "
                               f"{self.where(key)} ({size} -> {parts.total} bytes)")
        return parts.total

    def holds_file(self, key: str, path: str, *, check=None, gate=None) -> bool:
        """Whether object ``key`` already holds the bytes of the local file ``path``, as
        :meth:`put_file` would have put them: the same size and an ETag equal to the MD5s of
        the file read in parts of ``part_bytes`` (``check`` and ``gate`` as there). An
        upload cut off after this object was complete then does not send it again; an ETag
        that is no MD5 (some server-side encryption) is never taken for a match."""
        meta = self.head(key)
        if meta is None or meta["size"] != os.path.getsize(path) or not meta["e_tag"]:
            return False
        parts = _Parts(path, self.options.part_bytes, check, gate)
        if meta["size"] <= parts.part:
            digests, single = [hashlib.md5(parts.whole()).digest()], True
        else:
            for _ in parts:
                pass
            digests, single = parts.digests, False
        return meta["e_tag"].strip('"').lower() == _expected_etag(digests, single)

    # ---------------------------------------------------------------- ranged reads

    def read_into(self, key: str, items, *, verify: bool = True) -> "RangedReadResult":
        """Read ``items`` [(offset, nbytes, dst_address, chunk_bytes, crcs)] of object ``key``
        straight into memory, in pieces of about ``part_bytes`` (whole checksum chunks) with
        ``concurrency`` requests in flight; with ``verify``, each chunk's crc32c is compared
        with ``crcs``. The result says as ``_C.read_into``'s does what went wrong (the first
        failed request; every checksum mismatch; a short object)."""
        import obstore
        pieces = []
        for i, (offset, nbytes, address, chunk, crcs) in enumerate(items):
            per = max(1, self.options.part_bytes // chunk) * chunk
            for lo in range(0, nbytes, per):
                pieces.append((i, lo, min(per, nbytes - lo)))
        result = RangedReadResult()
        lock = threading.Lock()

        def one(piece) -> None:
            i, lo, n = piece
            offset, nbytes, address, chunk, crcs = items[i]
            with lock:
                if result.err or result.truncated:
                    return
            try:
                data = obstore.get_range(self.store, key, start=offset + lo, length=n)
            except Exception as e:
                with lock:
                    if not result.err:
                        result.err, result.msg, result.bad_item = 5, describe(e), i  # EIO
                return
            got = memoryview(data)
            if len(got) < n:
                with lock:
                    result.truncated.append((i, offset + lo + len(got)))
                return
            src = np.frombuffer(got, dtype=np.uint8)
            ctypes.memmove(address + lo, src.ctypes.data, n)
            if verify:
                first = lo // chunk
                for k in range(-(-n // chunk)):
                    a = k * chunk
                    crc = _io.crc32c(got[a:min(n, a + chunk)])
                    if crc != crcs[first + k]:
                        with lock:
                            result.mismatches.append((i, first + k, crc))

        if len(pieces) == 1:
            one(pieces[0])
        else:
            list(self.pool().map(one, pieces))
        result.mismatches.sort()
        result.truncated.sort()
        return result

    # ---------------------------------------------------------------- listings

    def list_all(self, prefix: str) -> list:
        """Every object under ``prefix/``: [{"path", "size", "e_tag"}]."""
        import obstore
        try:
            out = []
            for batch in obstore.list(self.store, prefix=prefix + "/" if prefix else None):
                out.extend(batch)
            return out
        except FileNotFoundError:
            return []
        except Exception as e:
            raise storage_error(f"cannot list {self.where(prefix)}", e) from e

    def delete_all(self, prefix: str) -> None:
        """Delete every object under ``prefix/`` (never the whole bucket: ``prefix`` empty is
        refused)."""
        if not prefix:
            raise ValueError("delete_all needs a prefix: it never empties a whole bucket")
        self.delete_keys([o["path"] for o in self.list_all(prefix)])

    def delete_keys(self, keys: list) -> None:
        """Delete the objects ``keys`` (1000 per request)."""
        import obstore
        try:
            for lo in range(0, len(keys), 1000):
                obstore.delete(self.store, keys[lo:lo + 1000])
        except Exception as e:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise storage_error(f"cannot delete {self.where(keys[0])}{more}", e) from e

    def delete(self, key: str) -> None:
        import obstore
        try:
            obstore.delete(self.store, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(f"cannot delete {self.where(key)}", e) from e


@dataclass
class RangedReadResult:
    """What :meth:`Bucket.read_into` found, as ``_C.ReadResult`` says it for a file."""

    err: int = 0
    msg: str = ""
    bad_item: int = -1
    mismatches: list = field(default_factory=list)  # (item, chunk, crc32c found)
    truncated: list = field(default_factory=list)  # (item, offset where the object ended)


def _expected_etag(digests: list, single: bool) -> str:
    """The ETag an S3 store gives bytes sent in one request (the MD5 of the bytes) or in
    parts (the MD5 of the parts' MD5s, with their count)."""
    if single:
        return digests[0].hex()
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _check_etag(where: str, etag, digests: list, single: bool) -> None:
    """Raise StorageError unless the store's ``etag`` is :func:`_expected_etag` of the bytes
    sent. An ETag that is no MD5 at all (some server-side encryption) is not compared."""
    if not etag:
        return
    etag = etag.strip('"')
    expected = _expected_etag(digests, single)
    body = etag.split("-", 1)[0]
    if len(body) != 32 or any(c not in "0123456789abcdef" for c in body.lower()):
        return
    if etag.lower() != expected:
        raise StorageError(f"{where}: the store holds other bytes than were sent (ETag {etag}, "
                           f"expected {expected})")


class _Parts:
    """A local file read in parts of ``part`` bytes (each part a fresh buffer, so obstore may
    hold several at once), ``gate()`` called before each read, every byte shown to
    ``check(offset, view)`` in order and every part's MD5 kept. What ``check`` or ``gate``
    raised is kept in ``refused`` (obstore wraps it)."""

    def __init__(self, path: str, part: int, check=None, gate=None):
        self.path, self.part, self.check, self.gate = path, part, check, gate
        self.digests: list = []
        self.total = 0
        self.refused: list = []

    def _kept(self, fn, *args) -> None:
        """``fn(*args)``, keeping what it raises (obstore reports it wrapped in its own)."""
        try:
            fn(*args)
        except BaseException as e:
            self.refused.append(e)
            raise

    def whole(self) -> bytes:
        if self.gate is not None:
            self._kept(self.gate)
        with open(self.path, "rb") as f:
            data = f.read()
        if self.check is not None:
            self._kept(self.check, 0, memoryview(data))
        self.total = len(data)
        return data

    def __iter__(self) -> Iterator[memoryview]:
        with open(self.path, "rb", buffering=0) as f:
            while True:
                if self.gate is not None:
                    self._kept(self.gate)
                view = memoryview(bytearray(self.part))
                n = 0
                while n < self.part:
                    got = f.readinto(view[n:])
                    if not got:
                        break
                    n += got
                if n == 0 and self.total > 0:
                    return
                piece = view[:n]
                if self.check is not None:
                    self._kept(self.check, self.total, piece)
                self.digests.append(hashlib.md5(piece).digest())
                self.total += n
                yield piece
                if n < self.part:
                    return


_buckets: dict = {}
_registered: dict = {}  # bucket name -> (options, factory)
_buckets_lock = threading.Lock()


def register(url: str, options=None, factory=None) -> None:
    """Reach the bucket of ``url`` with ``options`` in this process (``Config.remote_options``:
    ``gockpt.load`` and the tools then find the same store). ``factory(name, options)`` makes
    the :class:`Bucket` (default: the one registered before, else ``Bucket``); fault-injection tests pass a subclass that stops
    the real server at a chosen point."""
    name, _ = split(url)
    with _buckets_lock:
        entry = (RemoteOptions.of(options),
                 factory or _registered.get(name, (None, Bucket))[1])  # (kept: the test's)
        if _registered.get(name) != entry:
            _registered[name] = entry
            _buckets.pop(name, None)


def bucket_of(url: str) -> tuple:
    """(Bucket, key) of ``url``: the bucket's client made once per process."""
    name, key = split(url)
    with _buckets_lock:
        b = _buckets.get(name)
        if b is None:
            options, factory = _registered.get(name) or (RemoteOptions(), Bucket)
            b = _buckets[name] = factory(name, options)
    return b, key


# ------------------------------------------------------------------- as files

def read_small(url: str, limit: int, what: str) -> bytes:
    """:func:`~.manifest_file.read_small_file` for an object."""
    b, key = bucket_of(url)
    try:
        return b.get_small(key, limit)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def size_of(url: str) -> int:
    """The size of object ``url``: FileNotFoundError if there is none."""
    b, key = bucket_of(url)
    meta = b.head(key)
    if meta is None:
        raise FileNotFoundError(2, "no such object", url)
    return meta["size"]
