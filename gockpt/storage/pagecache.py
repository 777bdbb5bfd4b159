"""Page-cache residency of a data file's byte ranges, asked of the kernel with mincore(2), so
that the reader reads what is cached through the cache (a memcpy) and the rest with O_DIRECT
(no second copy through the cache). Nothing is read or faulted in to find out."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = None
_LOW_BIT = bytes(i & 1 for i in range(256))
# Residency is sampled: per item, up to _RES_SAMPLES windows of _RES_WINDOW pages, evenly spread.
_RES_SAMPLES = 16
_RES_WINDOW = 16


def _load_libc():
    """libc with mmap/munmap/mincore typed for ctypes (loaded once)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.mincore.restype = ctypes.c_int
        _libc = lib
    return _libc


def _resident(libc, addr: int, lo: int, items: list):
    """Per item, whether most of its sampled pages are resident in the mapping at ``addr``
    (file offset ``lo``); None if mincore fails."""
    page = mmap.PAGESIZE
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
            if libc.mincore(addr + p0 * page, n * page, vec) != 0:
                return None
            resident += vec.raw[:n].translate(_LOW_BIT).count(1)
            total += n
        out.append(2 * resident >= total)
    return out


def cached_items(fpath: str, items: list):
    """For each read item (offset, nbytes, ...): whether most of its pages are in the page cache,
    from mincore(2) on a read-only mapping of the file (sampled windows; nothing is read or
    faulted in). None if it cannot be asked (no mincore, mmap refused). Note: Linux reports
    page-cache state only to a process that owns the file or may write it; for others every
    item counts as not cached.
    """
    if not hasattr(os, "posix_fadvise"):  # POSIX systems with mincore only
        return None
    page = mmap.PAGESIZE
    lo = min(it[0] for it in items) // page * page
    hi = max(it[0] + it[1] for it in items)
    length = hi - lo
    if length <= 0:
        return None
    try:
        libc = _load_libc()
        fd = os.open(fpath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            return _resident(libc, addr, lo, items)
        finally:
            libc.munmap(addr, length)
    except (OSError, AttributeError, ValueError):
        return None


def split_by_residency(fpath: str, items: list) -> list:
    """Split read ``items`` into [(indices, direct)] groups: items mostly in the page cache are read
    buffered (a memcpy from the cache, where O_DIRECT would read the disk again), the others with
    O_DIRECT (no second copy through the cache). Cached group first; file order within each."""
    cached = cached_items(fpath, items)
    if cached is None:
        return [(list(range(len(items))), True)]
    groups = ([i for i, c in enumerate(cached) if c], False), ([i for i, c in enumerate(cached) if not c], True)
    return [g for g in groups if g[0]]
