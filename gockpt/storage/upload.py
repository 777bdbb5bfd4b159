"""One checkpoint's upload to the remote tier, as :class:`~.replicate.Replicator` runs it:
the files in the order that commits it (:func:`upload_order`, each data file with the check
of its bytes against its manifest's crc32c chunks), what a cut-off upload leaves in the store
and how it is found and deleted (:func:`find_leftovers`, :func:`drop_leftovers`), and the
CPU priority the uploads' threads run at (:func:`lower_priority`). No thread or queue of its
own: the Replicator decides what is uploaded and when.

One checkpoint's upload, in this order (a store's object appears whole or not at all, so the
order is the commit protocol):

0. where the store holds another checkpoint of that name (replaced locally), its manifest is
   deleted (:meth:`~.replicate.Replicator._unpublish_replaced`);
1. every data file of every part (``data.safetensors`` of the checkpoint and of each
   ``rank-*``), each byte checked against the manifest's crc32c chunks as it is read (a
   checkpoint damaged on the local disk is never replicated) and each part's MD5 against the
   store's ETag;
2. each part's ``manifest.json``, then the checkpoint's own ``manifest.json``: from then on the
   store holds a committed checkpoint (:func:`~.commit.is_committed`);
3. the store's ``latest``, the same pointer as on disk (name and manifest seal), moved only
   forward; then the store's retention (``Config.remote_keep_last``)."""

from __future__ import annotations

import bisect
import collections
import logging
import os
import re
import sys
import threading

from ..core.errors import CorruptCheckpointError, StorageError
from . import io as _io
from .commit import is_committed
from .format import CHUNK_BYTES_KEY, DATA_FILE, MANIFEST_FILE
from .manifest_file import read_manifest

log = logging.getLogger("gockpt")

UPLOAD_NICE = 19  # the CPU priority of the uploads' threads (Linux nice: the lowest)
STEP_NAME = re.compile(r"step-\d{9,}")  # format.checkpoint_name's
# the objects of a checkpoint whose upload was cut off before its manifest
LEFTOVER_OBJECT = re.compile(rf"(rank-\d{{5,}}/)?{re.escape(DATA_FILE)}|"
                             rf"rank-\d{{5,}}/{re.escape(MANIFEST_FILE)}")


def store_key(prefix: str, *names: str) -> str:
    """The store's key of ``names`` under ``prefix`` (the URL's path in its bucket)."""
    return "/".join([prefix, *names]) if prefix else "/".join(names)


def lower_priority() -> None:
    """The uploads' threads -- this one and obstore's runtime threads -- at the lowest CPU
    priority (nice ``UPLOAD_NICE``): where they compete with training for a core, training's
    threads go first; idle cores still serve the uploads at full speed. Linux only (a thread
    is a task there; elsewhere nothing changes). obstore's runtime serves this process's reads
    too: they run at that priority from then on (a load does not compete with training)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("tokio-"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), UPLOAD_NICE)
    except OSError:  # a task gone meanwhile, or a /proc not mounted: priority as it was
        pass


def find_leftovers(bucket, prefix: str, local: set) -> dict:
    """{name: its keys} of the checkpoints the store holds objects of under ``prefix`` but no
    manifest (an upload cut off), counting only what is surely gockpt's: a name of
    :func:`checkpoint_name`'s form or of a local checkpoint (``local``), holding nothing but
    data files and parts' manifests (so never a committed checkpoint: its manifest is none of
    them)."""
    found: dict = collections.defaultdict(list)  # name -> [(key under it, full key)]
    for meta in bucket.list_all(prefix):
        rel = meta["path"][len(prefix) + 1:] if prefix else meta["path"]
        name, sep, rest = rel.partition("/")
        if sep:
            found[name].append((rest, meta["path"]))
    return {name: [key for _, key in objects] for name, objects in found.items()
            if (name in local or STEP_NAME.fullmatch(name))
            and all(LEFTOVER_OBJECT.fullmatch(rest) for rest, _ in objects)}


def drop_leftovers(bucket, url: str, prefix: str, name: str) -> None:
    """Delete what the store holds of checkpoint ``name`` (given up: never completed here)
    unless it is committed there -- gockpt's objects only (``LEFTOVER_OBJECT``)."""
    try:
        if is_committed(f"{url}/{name}"):
            return
        under = store_key(prefix, name)
        keys = [o["path"] for o in bucket.list_all(under)
                if LEFTOVER_OBJECT.fullmatch(o["path"][len(under) + 1:])]
    except StorageError as e:
        log.warning("gockpt: could not look up what a cut-off upload left of %s in %s "
                    "(%s)", name, url, e)
        return
    delete_leftovers(bucket, url, {name: keys})


def delete_leftovers(bucket, url: str, found: dict) -> None:
    """Delete the objects ``found`` ({name: keys}) of uploads that will never complete
    (nothing lists them as a checkpoint, but they take space). Best effort: a store that
    refuses (no delete permission, object lock) keeps them, with a warning; uploads go on."""
    for name, keys in found.items():
        try:
            bucket.delete_keys(keys)
        except StorageError as e:
            log.warning("gockpt: could not delete what a cut-off upload left of %s in %s "
                        "(%s); it stays there, unlisted", name, url, e)


def upload_order(path: str) -> list:
    """Every file of checkpoint ``path`` in upload order -- the data files, the parts'
    manifests, the checkpoint's manifest last -- each data file with the check of its bytes
    against the chunk checksums its manifest records."""
    files = sorted(os.path.relpath(os.path.join(d, f), path)
                   for d, _, names in os.walk(path) for f in names)
    manifests = [rel for rel in files if os.path.basename(rel) == MANIFEST_FILE]
    manifests.sort(key=lambda rel: (rel == MANIFEST_FILE, rel))  # the top one last
    entries: dict = {}  # data file -> its manifest's entries
    for rel in manifests:
        d = os.path.dirname(rel)
        for e in read_manifest(os.path.join(path, d) if d else path)["tensors"].values():
            entries.setdefault(os.path.join(d, e["file"]) if d else e["file"], []).append(e)
    data = [(rel, ChunkCheck(os.path.join(path, rel), entries.get(rel, [])))
            for rel in files if rel not in manifests]
    return data + [(rel, None) for rel in manifests]


class ChunkCheck:
    """Checks the bytes of one data file as they stream by (in order) against the crc32c of
    every checksum chunk its manifest entries record; raises CorruptCheckpointError naming the
    file and chunk at the first mismatch."""

    def __init__(self, where: str, entries: list):
        self.where = where
        bounds = []
        for e in entries:
            chunk, off, n = e[CHUNK_BYTES_KEY], e["offset"], e["nbytes"]
            for k, crc in enumerate(e["crc32c"]):
                lo = off + k * chunk
                bounds.append((lo, min(off + n, lo + chunk), crc))
        bounds.sort()
        self.starts = [b[0] for b in bounds]
        self.bounds = bounds
        self.partial: dict = {}  # chunk index -> crc so far

    def __call__(self, offset: int, view: memoryview) -> None:
        if offset == 0:  # read again from the start (Bucket.holds_file, then put_file)
            self.partial.clear()
        end = offset + len(view)
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while i < len(self.bounds) and self.bounds[i][0] < end:
            lo, hi, expected = self.bounds[i]
            a, b = max(lo, offset), min(hi, end)
            if a < b:
                crc = _io.crc32c(view[a - offset:b - offset], self.partial.pop(i, 0))
                if b == hi:
                    if crc != expected:
                        raise CorruptCheckpointError(
                            f"{self.where}: bytes {lo}..{hi} do not match their checksum "
                            f"(crc32c {crc:#010x}, expected {expected:#010x}): the local "
                            "checkpoint is damaged and is not uploaded")
                else:
                    self.partial[i] = crc
            i += 1
