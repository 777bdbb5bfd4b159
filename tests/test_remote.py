"""The remote tier against a real S3-compatible server (SeaweedFS on the loopback interface,
started by the fixture): checkpoints replicated in the background, loaded from ``s3://`` in a
fresh process bit for bit, and the faults -- the server killed or paused mid-upload, an object
damaged in the store, the training process killed mid-upload and restarted."""

import json
import logging
import os
import shutil
import sys
import tempfile
import threading

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.core.errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                                StorageError)
from gockpt.storage import remote, replicate, upload
from gockpt.storage.format import CHUNK_BYTES_KEY
from gockpt.storage.schema import is_small_tensor
from gockpt.storage.commit import list_checkpoints, read_latest
from tests._support import harness as H
from tests._support import ranks_worker
from tests._support.dist_ranks import run_ranks
from tests._support import worker_env
from tests._support.forked import Forked, run_worker
from tests._support.cli_helpers import run
from tests._support.s3server import S3Server


# The longest a test waits for uploads: a fault that is never healed fails the test
# (its status names what is left) instead of holding the suite without end.
BOUND_S = 300


def fast(**more) -> dict:
    """Options under which a failing store fails fast (a paused server times out in 2 s)."""
    return dict(remote_retry_s=0.05, remote_options=dict(timeout_s=2.0, connect_timeout_s=1.0,
                                                         max_retries=0, part_bytes=5 << 20,
                                                         **more))


def big_model():
    """A model whose checkpoint is a multipart upload (a 28 MB data file in 5 MiB parts)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1536, 1536), torch.nn.Linear(1536, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, opt, ck, steps, start=0, seed=0):
    """Steps ``start`` .. ``steps`` - 1, each on the batch of its step (``seed``: other batches)."""
    for step in range(start, steps):
        x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(seed + step))
        loss = model(x).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)


def committed_locally(directory, steps):
    """A run without the remote tier: a checkpoint every 2 steps up to ``steps``, on disk
    only; its model and optimizer."""
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2)
    train(model, opt, ck, steps)
    ck.close()
    return model, opt


def loads_equal(source, tag=None):
    """The state stored at ``source`` (a directory or URL), as gockpt.load gives it."""
    model, opt = big_model()
    restored = gockpt.load(source, model, opt, tag=tag)
    return restored, H.snapshot(model, opt)


class Faulty(remote.Bucket):
    """The real bucket, with ``fault(self, key)`` run before the first put of an object of the
    checkpoint named ``at`` (or of the object ``at`` = ``name/file``) and ``heal(self)`` before
    the next request of the upload once that put has returned or failed (the retry's; not a
    request of another thread while the faulted one still waits: was a put that a parallel
    request's heal let through, under load)."""

    at, fault, heal = None, None, None
    state: dict = {}
    latest_puts: list = []  # (name, every object of the checkpoint in the store when it was put)

    def _heal(self):
        cls = type(self)
        if cls.state.get("over") and not cls.state.get("healed"):
            cls.state["healed"] = True
            cls.heal(self)

    def head(self, key):
        self._heal()
        return super().head(key)

    def get_small(self, key, limit):
        self._heal()
        return super().get_small(key, limit)

    def delete(self, key):
        self._heal()
        return super().delete(key)

    def put_file(self, key, path, **kw):
        cls = type(self)
        self._heal()
        if (f"/{cls.at}/" in f"/{key}" or key.endswith(f"/{cls.at}")) \
                and not cls.state.get("faulted"):
            cls.state["faulted"] = True
            cls.fault(self, key)
            try:
                return super().put_file(key, path, **kw)
            finally:
                cls.state["over"] = True
        return super().put_file(key, path, **kw)

    def put_bytes(self, key, data):
        if key.endswith("/latest"):
            name = data.decode().split("\n")[0]
            prefix = key[:-len("latest")] + name
            type(self).latest_puts.append((name, sorted(
                o["path"][len(prefix) + 1:] for o in self.list_all(prefix))))
        return super().put_bytes(key, data)


def faulty(at, fault, heal):
    cls = type("FaultyBucket", (Faulty,), {"at": at, "fault": staticmethod(fault),
                                          "heal": staticmethod(heal), "state": {},
                                          "latest_puts": []})
    return cls


def every_object(directory, name):
    root = os.path.join(directory, name)
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


def every_file(directory, name):
    return [os.path.join(directory, name, rel) for rel in every_object(directory, name)]


# ------------------------------------------------------------------------------- round trips

@pytest.mark.slow
def test_a_fresh_process_resumes_from_the_store_bit_for_bit_after_the_local_directory_is_gone(
        tmp_path, url):
    directory = str(tmp_path / "run")

    def run(*args):  # a fresh process (forked: tests._support.forked)
        return run_worker("remote_worker", *args, env=worker_env(), timeout=300)

    trained = run("train", directory, url, 30, 22)
    assert trained.returncode == -9, trained.stderr
    shutil.rmtree(directory)  # the node is gone: only the store is left
    assert read_latest(url)[0] == storage.checkpoint_name(20)
    resumed = run("resume", url, 30)
    assert resumed.returncode == 0, resumed.stderr
    straight = run("straight", 30)
    assert straight.returncode == 0, straight.stderr
    got, want = json.loads(resumed.stdout), json.loads(straight.stdout)
    assert got["start"] == 20
    assert got["losses"] == want["losses"][20:]
    assert got["digest"] == want["digest"]


def test_every_checkpoint_is_replicated_data_first_and_loads_from_the_store_as_on_disk(
        tmp_path, url):
    directory = str(tmp_path / "run")
    remote.register(url, factory=faulty(None, None, None))
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    train(model, opt, ck, 4)
    status = ck.wait_remote(BOUND_S)
    ck.close()
    assert status.uploaded == [storage.checkpoint_name(2), storage.checkpoint_name(4)]
    assert status.error is None and not status.pending
    latest_puts = remote.bucket_of(url)[0].latest_puts
    # latest was put only when every object of its checkpoint was in the store
    assert latest_puts == [(n, every_object(directory, n)) for n in status.uploaded]
    uploads = gockpt.metrics.read(directory, record="upload")
    assert [u["name"] for u in uploads] == status.uploaded
    assert all(u["bytes"] > 28e6 and u["gbps"] > 0 for u in uploads)
    for name in status.uploaded:
        a, b = loads_equal(url, tag=name), loads_equal(directory, tag=name)
        assert a[0].step == b[0].step
        H.assert_same(a[1], b[1])
    assert gockpt.verify(f"{url}/{storage.checkpoint_name(4)}").ok


def test_the_store_keeps_its_own_number_of_checkpoints(tmp_path, url):
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path / "run"), interval=1, remote=url,
                             remote_keep_last=2, remote_wait_s=None, **fast())
    train(model, opt, ck, 4)
    ck.close()
    assert list_checkpoints(url) == [storage.checkpoint_name(3), storage.checkpoint_name(4)]
    assert len(list_checkpoints(str(tmp_path / "run"))) == 4
    assert read_latest(url)[0] == storage.checkpoint_name(4)


def dcp_save(model, opt, directory, step, **writer):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from gockpt.storage.dcp import GockptWriter
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd, "train_state": {"step": step}},
             storage_writer=GockptWriter(directory, step=step, **writer))


@pytest.mark.filterwarnings("ignore:.*keeps no RNG states")
def test_a_dcp_writer_uploads_its_checkpoints_and_they_load_from_the_store(tmp_path, url):
    from gockpt.storage.dcp import wait_uploads
    directory = str(tmp_path / "run")
    model, opt = big_model()
    states = {}
    for step in (1, 2, 3):
        opt.zero_grad()
        model(torch.randn(4, 1536, generator=torch.Generator().manual_seed(step))).square() \
            .mean().backward()
        opt.step()
        dcp_save(model, opt, directory, step, keep_last=2, remote=url, remote_keep_last=2,
                 remote_options=fast()["remote_options"])
        states[step] = H.snapshot(model, opt)
    # (this process's other uploads: other tests' in the same pytest worker)
    [status] = [s for s in wait_uploads(120) if s.url == url]
    assert status.error is None and not status.pending and not status.uploading, status
    assert storage.checkpoint_name(3) in status.uploaded
    assert list_checkpoints(url) == [storage.checkpoint_name(2), storage.checkpoint_name(3)]
    assert read_latest(url)[0] == storage.checkpoint_name(3)
    for step in (2, 3):
        restored, got = loads_equal(url, tag=storage.checkpoint_name(step))
        assert restored.step == step and restored.extra_state["train_state.step"] == step
        H.assert_same(got, states[step])
    assert gockpt.verify(f"{url}/{storage.checkpoint_name(3)}").ok
    with pytest.raises(ConfigError, match="remote_keep_last must be None or an int >= 1"):
        dcp_save(model, opt, directory, 4, remote=url, remote_keep_last=0)
    with pytest.raises(ConfigError, match="need remote="):
        dcp_save(model, opt, directory, 4, remote_wait_s=5)
    with pytest.raises(ConfigError, match="GockptWriter: remote"):
        dcp_save(model, opt, directory, 4, remote="bucket/prefix")


def test_a_process_that_saved_through_dcp_uploads_at_its_end(tmp_path, url):
    directory = str(tmp_path / "run")
    done = run_worker("remote_worker", "dcp", directory, url, 3, env=worker_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    # the worker returned right after its last save: its end waited for the uploads
    assert list_checkpoints(url) == [storage.checkpoint_name(s) for s in (1, 2, 3)]
    model, opt, _ = H.build()
    gockpt.load(url, model, opt, restore_rng=False)
    assert H.state_digest(model, opt) == json.loads(done.stdout)["digest"]


# ------------------------------------------------------------------------------- faults

def test_a_server_killed_mid_upload_leaves_the_previous_latest_and_the_upload_completes_after(
        tmp_path, url, server):
    """The server dies (SIGKILL) right before the first object of the second checkpoint is
    put: that upload fails, training and the local checkpoint are untouched, the store's
    latest still names the first; the retry after the server is back completes it."""
    directory = str(tmp_path / "run")
    second = storage.checkpoint_name(4)
    seen = {}

    def kill(bucket, key):
        seen["latest"] = read_latest(url)[0]
        server.kill()

    remote.register(url, fast()["remote_options"],
                    factory=faulty(second, kill, lambda bucket: server.start()))
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    train(model, opt, ck, 4)
    status = ck.wait_remote(BOUND_S)
    ck.close()
    assert seen["latest"] == storage.checkpoint_name(2)
    assert status.uploaded == [storage.checkpoint_name(2), second] and status.error is None
    uploads = gockpt.metrics.read(directory, record="upload")
    # the first attempt failed; a server back from a crash may refuse a few more
    assert [u["name"] for u in uploads] == status.uploaded
    assert uploads[0]["attempts"] == 1 and uploads[1]["attempts"] >= 2
    bucket = remote.bucket_of(url)[0]
    assert [n for n, _ in bucket.latest_puts] == [storage.checkpoint_name(2), second]
    assert bucket.latest_puts[-1][1] == every_object(directory, second)
    H.assert_same(loads_equal(url)[1], loads_equal(directory)[1])


def test_a_server_paused_past_the_timeout_fails_the_upload_and_it_is_retried(
        tmp_path, url, server):
    """The server stops (SIGSTOP) right before the second checkpoint's manifest is put, after
    its data object (a multipart upload) is in the store: the put times out, the retry finds
    the data object holding the same bytes and sends only the manifest."""
    directory = str(tmp_path / "run")
    second = storage.checkpoint_name(4)
    remote.register(url, fast()["remote_options"],
                    factory=faulty(f"{second}/manifest.json", lambda bucket, key: server.pause(),
                                   lambda bucket: server.resume()))
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    try:
        train(model, opt, ck, 4)
        status = ck.wait_remote(BOUND_S)
    finally:
        server.resume()
    ck.close()
    assert status.uploaded == [storage.checkpoint_name(2), second] and status.error is None
    uploads = gockpt.metrics.read(directory, record="upload")
    assert [u["attempts"] for u in uploads][0] == 1 and uploads[1]["attempts"] >= 2
    data = os.path.join(directory, second, "data.safetensors")
    assert os.path.getsize(data) > 5 << 20  # in parts: the ETag is the MD5 of their MD5s
    assert uploads[0]["reused"] == [] \
        and uploads[0]["bytes"] == sum(map(os.path.getsize, every_file(directory, uploads[0]["name"])))
    assert uploads[1]["reused"] == ["data.safetensors"] \
        and uploads[1]["bytes"] == os.path.getsize(os.path.join(directory, second, "manifest.json"))
    H.assert_same(loads_equal(url)[1], loads_equal(directory)[1])


def test_an_object_of_the_same_size_but_other_bytes_is_sent_again(tmp_path, url):
    """A data object in the store that has the local file's size but not its bytes (here one
    byte flipped, in the same parts) is no reason to skip it: the upload sends it again and
    the store's checkpoint loads as the local one."""
    directory = str(tmp_path / "run")
    name = storage.checkpoint_name(2)
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, remote_wait_s=None,
                             **fast())
    train(model, opt, ck, 2)
    ck.close()
    bucket, prefix = remote.bucket_of(url)
    local = os.path.join(directory, name, "data.safetensors")
    other = str(tmp_path / "other.safetensors")
    shutil.copyfile(local, other)
    with open(other, "r+b") as f:
        f.seek(os.path.getsize(other) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    bucket.put_file(f"{prefix}/{name}/data.safetensors", other)  # multipart, same size
    for key in (f"{prefix}/{name}/manifest.json", f"{prefix}/latest"):  # as if cut off
        bucket.delete(key)
    ck = gockpt.Checkpointer(model, opt, directory, remote=url, remote_wait_s=None, **fast())
    ck.close()
    record = gockpt.metrics.read(directory, record="upload")[-1]
    assert record["name"] == name and record["reused"] == []
    assert record["bytes"] == sum(map(os.path.getsize, every_file(directory, name)))
    H.assert_same(loads_equal(url)[1], loads_equal(directory)[1])


class RefusesDeletes(remote.Bucket):
    def delete_keys(self, keys):
        raise StorageError("AccessDenied: the bucket's policy refuses DeleteObject")


def test_a_store_that_refuses_deletes_keeps_leftovers_and_the_uploads_go_on(tmp_path, url,
                                                                            caplog):
    """Leftovers of a cut-off upload in a store that refuses deletes (object lock, no
    DeleteObject permission) stay there, with a warning; every checkpoint is uploaded."""
    directory = str(tmp_path / "run")
    model, opt = committed_locally(directory, 2)
    remote.register(url, fast()["remote_options"], factory=RefusesDeletes)
    bucket, prefix = remote.bucket_of(url)
    gone = f"{prefix}/{storage.checkpoint_name(1)}/data.safetensors"  # no such local checkpoint
    bucket.put_bytes(gone, b"what a killed upload left")
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    train(model, opt, ck, 4, start=2)
    status = ck.wait_remote(120)
    ck.close()
    assert status.uploaded == [storage.checkpoint_name(2), storage.checkpoint_name(4)]
    assert status.error is None and bucket.head(gone) is not None
    assert "could not delete what a cut-off upload left" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities: Linux")
def test_the_uploads_run_at_the_lowest_cpu_priority(tmp_path, url):
    """The replicator's thread and obstore's runtime threads run at nice 19 (training's
    threads go first where they compete for a core); the training thread is left as it was."""
    directory = str(tmp_path / "run")
    model, opt = big_model()
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    train(model, opt, ck, 2)
    assert ck.wait_remote(120).uploaded == [storage.checkpoint_name(2)]
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names[int(tid)] = f.read().strip()
    runtime = [t for t, n in names.items() if n.startswith("tokio-")]
    assert runtime, names
    uploaders = [ck.tiers.remote.replicator._thread.native_id] + runtime
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in uploaders} == {upload.UPLOAD_NICE}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    ck.close()


class HeldAtFirstPut(remote.Bucket):
    """The real bucket; the first put waits until the test sets ``go`` (``entered`` says it
    is there): meanwhile the test commits more checkpoints than the store takes."""

    entered, go = None, None

    def put_file(self, key, path, **kw):
        type(self).entered.set()
        type(self).go.wait()
        return super().put_file(key, path, **kw)


def behind(url, directory, n, keep_last):
    """``n`` local checkpoints (steps 2, 4, ...) submitted to a Replicator whose first upload
    is held until all are queued; returns (names, status when done, the store's list)."""
    committed_locally(directory, 2 * n)
    names = [storage.checkpoint_name(2 * i) for i in range(1, n + 1)]
    cls = type("Held", (HeldAtFirstPut,), {"entered": threading.Event(), "go": threading.Event()})
    remote.register(url, fast()["remote_options"], factory=cls)
    rep = replicate.Replicator(directory, url, keep_last=keep_last)
    rep.submit(names[0])
    assert cls.entered.wait(60)  # the first upload is under way
    for name in names[1:]:
        rep.submit(name)
    queued = rep.status()
    cls.go.set()
    assert rep.wait(120)
    rep.close()
    return names, queued, rep.status(), list_checkpoints(url)


def test_uploads_that_fall_behind_skip_what_the_stores_retention_would_delete(tmp_path, url):
    """remote_keep_last=2 and 4 checkpoints committed while the first uploads: of the 3
    waiting, the oldest is not uploaded at all (the store's retention would delete it at
    once); the store holds the 2 newest."""
    names, queued, status, stored = behind(url, str(tmp_path / "run"), 4, keep_last=2)
    assert queued.uploading == names[0] and queued.pending == names[2:]
    assert status.superseded == [names[1]] and status.uploaded == [names[0]] + names[2:]
    assert stored == names[2:]


def test_uploads_that_fall_behind_say_so_once(tmp_path, url, caplog):
    names, queued, status, stored = behind(url, str(tmp_path / "run"), 4, keep_last=None)
    assert queued.pending == names[1:] and status.superseded == []
    assert status.uploaded == names and stored == names
    assert caplog.text.count("fall behind the checkpoints (3 committed ones wait)") == 1


def test_close_uploads_what_is_left_and_says_how_far_it_is(tmp_path, url, monkeypatch,
                                                           caplog):
    """The job's last checkpoint must leave the node before the job ends: close() (default
    remote_wait_s) waits for its upload, held here until close() has said how far the uploads
    are; the store then holds it (close() left it to a next run before)."""
    directory = str(tmp_path / "run")
    last = storage.checkpoint_name(4)
    said = threading.Event()

    class Said(logging.Handler):
        def emit(self, record):
            if "close() waits for the uploads" in record.getMessage():
                said.set()

    monkeypatch.setattr(replicate, "PROGRESS_S", 0.05)
    logging.getLogger("gockpt").addHandler(handler := Said())
    remote.register(url, fast()["remote_options"],
                    factory=faulty(last, lambda bucket, key: said.wait(60), lambda bucket: None))
    try:
        model, opt = big_model()
        ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
        train(model, opt, ck, 4)
        ck.wait()  # committed locally; its upload held until close() says it waits for it
        ck.close()
    finally:
        logging.getLogger("gockpt").removeHandler(handler)
    assert said.is_set() and f"uploading {last}" in caplog.text
    assert read_latest(url)[0] == last
    H.assert_same(loads_equal(url)[1], loads_equal(directory)[1])


def test_close_gives_up_on_a_failing_store_and_says_what_is_left(tmp_path, url, server):
    """A store that stops answering while close() waits: close() returns after the failed
    upload (the job must end) with a warning naming the checkpoint left, which the next
    Checkpointer of the directory uploads."""
    directory = str(tmp_path / "run")
    last = storage.checkpoint_name(4)
    remote.register(url, fast()["remote_options"],
                    factory=faulty(last, lambda bucket, key: server.pause(),
                                   lambda bucket: server.resume()))
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    try:
        train(model, opt, ck, 4)
        ck.wait()
        with pytest.warns(UserWarning, match=f"close\\(\\) leaves checkpoints not uploaded: "
                          f".*not uploaded: {last}"):
            ck.close()
    finally:
        server.resume()
    assert read_latest(url)[0] == storage.checkpoint_name(2)
    remote.register(url, fast()["remote_options"], factory=remote.Bucket)
    model, opt = big_model()
    gockpt.Checkpointer(model, opt, directory, remote=url, **fast()).close()  # the next run
    assert read_latest(url)[0] == last
    H.assert_same(loads_equal(url)[1], loads_equal(directory)[1])


def test_a_checkpoint_deleted_locally_mid_upload_leaves_nothing_in_the_store(tmp_path, url):
    """Local retention (or a user) deletes the second checkpoint after its data object reached
    the store, before its manifest: the upload gives it up and deletes that object (not an
    object under the same name that is not gockpt's); the store's latest stays on the
    first."""
    directory = str(tmp_path / "run")
    second = storage.checkpoint_name(4)
    def delete_it(bucket, key):
        shutil.rmtree(os.path.join(directory, second))
        bucket.put_bytes(key.replace("manifest.json", "notes.txt"), b"not gockpt's")

    remote.register(url, fast()["remote_options"], factory=faulty(
        f"{second}/manifest.json", delete_it, lambda bucket: None))
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    train(model, opt, ck, 4)
    status = ck.wait_remote(BOUND_S)
    ck.close()
    bucket, prefix = remote.bucket_of(url)
    assert type(bucket).state.get("faulted")
    assert status.uploaded == [storage.checkpoint_name(2)] and status.error is None
    assert read_latest(url)[0] == storage.checkpoint_name(2)
    assert [o["path"] for o in bucket.list_all(f"{prefix}/{second}")] == \
        [f"{prefix}/{second}/notes.txt"]  # gockpt's objects deleted, nothing else


class WatchesTheGate(remote.Bucket):
    """The real bucket, noting at each part read (right after the replicator's gate let it
    through) whether ``busy`` was set; ``go`` (if set up) holds the first put until the test
    sets it; ``done`` is set when a ``latest`` is put (the last request of an upload)."""

    entered = None  # set when the gate is first called
    busy = None  # the event the replicator's yield_to gives
    go = None
    done = None
    reads: list = []

    def put_file(self, key, path, *, check=None, gate=None):
        if type(self).go is not None:
            type(self).go.wait()
        return super().put_file(key, path, check=check, gate=self._watched(gate))

    def holds_file(self, key, path, *, check=None, gate=None):
        return super().holds_file(key, path, check=check, gate=self._watched(gate))

    def put_bytes(self, key, data):
        etag = super().put_bytes(key, data)
        if key.endswith("/latest"):
            type(self).done.set()
        return etag

    def _watched(self, gate):
        cls = type(self)

        def watched():
            cls.entered.set()
            gate()
            cls.reads.append(cls.busy.is_set())
        return watched


def watching(url, monkeypatch, hold_s, go=None):
    """A bucket class for ``url`` that watches the replicator's gate (MAX_HOLD_S = hold_s)."""
    monkeypatch.setattr(replicate, "MAX_HOLD_S", hold_s)
    cls = type("Watching", (WatchesTheGate,), {
        "entered": threading.Event(), "busy": threading.Event(), "done": threading.Event(),
        "go": go, "reads": []})
    remote.register(url, fast()["remote_options"], factory=cls)
    return cls


def watched_upload(tmp_path, url, monkeypatch, hold_s):
    """The checkpoint of step 2, committed locally, submitted to a Replicator whose uploads
    yield to ``cls.busy`` (unset: copies in progress) with the gate watched; (directory, cls,
    replicator)."""
    directory = str(tmp_path / "run")
    committed_locally(directory, 2)
    cls = watching(url, monkeypatch, hold_s=hold_s)
    rep = replicate.Replicator(directory, url, yield_to=lambda: cls.busy)
    rep.submit(storage.checkpoint_name(2))
    return directory, cls, rep


def test_uploads_pause_while_a_checkpoint_is_copied_during_training(tmp_path, url, monkeypatch):
    """While training is in a checkpoint's copies (the time its hooks may block), no part of
    an upload is read: the remote tier never competes with them. The test holds the copies
    "in progress" until the upload has reached its first part, then ends them."""
    _, cls, rep = watched_upload(tmp_path, url, monkeypatch, hold_s=3600.0)
    assert cls.entered.wait(60)
    assert cls.reads == []  # held at the gate: nothing read while the copies go on
    cls.busy.set()  # the copies end: the upload goes on
    assert cls.done.wait(60)  # (nobody waits on the replicator: the gate alone let it go)
    rep.close(None)
    assert rep.status().uploaded == [storage.checkpoint_name(2)]
    assert len(cls.reads) > 1 and all(cls.reads), cls.reads  # the 28 MB file in 5 MiB parts


def test_uploads_pause_at_most_max_hold_s_for_one_checkpoints_copies(tmp_path, url,
                                                                     monkeypatch):
    """Copies that never end (a window left open) hold the uploads MAX_HOLD_S in all, not
    per part: the whole upload goes on after one hold."""
    directory, cls, rep = watched_upload(tmp_path, url, monkeypatch, hold_s=0.5)
    assert cls.done.wait(60)
    rep.close(None)
    assert rep.status().uploaded == [storage.checkpoint_name(2)]
    assert len(cls.reads) > 1 and not any(cls.reads)
    (record,) = gockpt.metrics.read(directory, record="upload")
    # one hold, not one per part; paused_s sums the gate's waits, not the loop's own time
    # between them (measured 0.49999 s once for a 0.5 s hold): at least most of the hold
    assert 0.4 <= record["paused_s"] < 0.5 * len(cls.reads), record


def test_wait_remote_is_not_held_by_a_window_that_is_open(tmp_path, url, monkeypatch):
    """ck.wait_remote() while a gockpt-o window is open for a checkpoint whose step has not
    come: training is not running, the caller wants the uploads, so they do not pause for
    those copies (which would end only when training goes on)."""
    directory = str(tmp_path / "run")
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, directory, scheduler=sched)
    H.train_steps(model, opt, sched, 0, 2, ck, force=[2])
    ck.close()
    go = threading.Event()  # the upload of step 2 starts once the window is open
    watching(url, monkeypatch, hold_s=3600.0, go=go)
    ck = gockpt.Checkpointer(model, opt, directory, mode="gockpt-o", overlap_steps=3,
                             block_bytes=512, scheduler=sched, remote=url, **fast())
    H.train_steps(model, opt, sched, 2, 6, ck, at=[8])
    assert ck._copies_in_progress() is not None  # the window of step 8 is open
    go.set()
    status = ck.wait_remote(120)  # (would pause for the hour the window stays open)
    assert status.uploaded == [storage.checkpoint_name(2)] and not status.pending
    assert ck._copies_in_progress() is not None
    ck.close()


def test_the_checkpointer_names_its_copies_in_progress_to_the_remote_tier():
    """gockpt-o over 3 steps for the checkpoint of step 6: from the window's first step to
    the first hook after step 6 (which closes the checkpoint's accounts of blocked time) the
    copies are in progress (an event the uploads wait for); before and after, none."""
    model, opt, sched = H.build()
    with tempfile.TemporaryDirectory() as d:
        ck = gockpt.Checkpointer(model, opt, d, mode="gockpt-o", overlap_steps=3,
                                 block_bytes=512, scheduler=sched)
        seen = []
        H.train_steps(model, opt, sched, 0, 8, ck, at=[6],
                      on_boundary=lambda step, handle: seen.append(
                          (step, ck._copies_in_progress() is not None)))
        ck.wait()
        assert ck._copies_in_progress() is None
        ck.close()
    busy = [step for step, b in seen if b]
    assert busy == [4, 5, 6], seen


def test_a_byte_flipped_in_the_store_is_a_named_error_at_load(tmp_path, url):
    directory = str(tmp_path / "run")
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, remote_wait_s=None,
                             **fast())
    train(model, opt, ck, 2)
    ck.close()
    name = storage.checkpoint_name(2)
    bucket, key = remote.bucket_of(f"{url}/{name}/data.safetensors")
    manifest = storage.read_manifest(os.path.join(directory, name))
    entry = manifest["tensors"]["model/0.weight"]
    with open(os.path.join(directory, name, "data.safetensors"), "rb") as f:
        data = bytearray(f.read())
    at = entry["offset"] + 2 * entry[CHUNK_BYTES_KEY] + 3  # in its third (last) chunk
    data[at] ^= 0x10
    bucket.put_bytes(key, bytes(data))
    fresh, fresh_opt = big_model()
    with pytest.raises(CorruptCheckpointError,
                       match=r"s3://.*data\.safetensors.*'model/0\.weight'.*block 2 .*checksum "
                             r"mismatch"):
        gockpt.load(url, fresh, fresh_opt)
    report = gockpt.verify(f"{url}/{name}")
    assert not report.ok and "model/0.weight" in str(report)


def test_a_checkpoint_damaged_on_the_local_disk_is_not_uploaded(tmp_path, url):
    directory = str(tmp_path / "run")
    model, opt = committed_locally(directory, 2)
    name = storage.checkpoint_name(2)
    entry = storage.read_manifest(os.path.join(directory, name))["tensors"]["model/1.weight"]
    with open(os.path.join(directory, name, "data.safetensors"), "r+b") as f:
        f.seek(entry["offset"] + 7)
        b = f.read(1)
        f.seek(entry["offset"] + 7)
        f.write(bytes([b[0] ^ 1]))
    ck = gockpt.Checkpointer(model, opt, directory, remote=url, **fast())
    status = ck.wait_remote(BOUND_S)
    ck.close()
    assert status.uploaded == [] and "data.safetensors" in status.error \
        and "damaged" in status.error
    assert list_checkpoints(url) == [] and read_latest(url) == (None, None)


@pytest.mark.slow
def test_a_training_process_killed_mid_upload_leaves_no_partial_latest_and_the_next_run_uploads(
        tmp_path, url):
    directory = str(tmp_path / "run")
    first, second = storage.checkpoint_name(5), storage.checkpoint_name(10)
    proc = Forked("remote_worker", ["hang", directory, url, "12"], worker_env(), stream=True)
    try:
        line = proc.stdout.readline()  # blocks until the worker is inside the upload
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert line.strip() == f"uploading {second}", (line, err)
    assert read_latest(url)[0] == first  # the second is committed locally, not in the store
    assert list_checkpoints(url) == [first]
    assert storage.list_checkpoints(directory) == [first, second]
    bucket, prefix = remote.bucket_of(url)
    assert bucket.head(f"{prefix}/{second}/data.safetensors") is not None  # its data is there
    # what such a run leaves of a checkpoint deleted locally since (a name no local checkpoint
    # has): the next run deletes it, and nothing of the prefix that is not gockpt's
    gone = storage.checkpoint_name(7)
    local_data = os.path.join(directory, second, "data.safetensors")
    bucket.put_file(f"{prefix}/{gone}/data.safetensors", local_data)
    others = [f"{prefix}/notes/data.safetensors", f"{prefix}/{storage.checkpoint_name(8)}/x.txt"]
    for key in others:
        bucket.put_bytes(key, b"not gockpt's")
    out = run_worker("remote_worker", "upload", directory, url, env=worker_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["uploaded"] == [second]
    assert read_latest(url)[0] == second
    # the data object already in the store is not sent again: only the manifest is
    record = result["records"][-1]
    assert record["name"] == second and record["reused"] == ["data.safetensors"]
    assert record["bytes"] == os.path.getsize(os.path.join(directory, second, "manifest.json"))
    assert bucket.list_all(f"{prefix}/{gone}") == []
    assert all(bucket.head(key) is not None for key in others)
    H.assert_same(loads_equal_small(url), loads_equal_small(directory))


def test_a_checkpoint_a_killed_job_committed_after_latest_is_not_uploaded_at_start(tmp_path,
                                                                                    url):
    """What an earlier run committed but did not upload goes to the store at the next start,
    up to the local ``latest``: a checkpoint committed after it by a job killed before it
    named it is not the run's (the resumed job saves that step again), and the store's
    ``latest`` does not move to it."""
    directory = str(tmp_path / "run")
    committed_locally(directory, 4)
    storage.commit.write_latest(directory, storage.checkpoint_name(2))  # (killed before it)
    remote.register(url, fast()["remote_options"])
    rep = replicate.Replicator(directory, url)
    rep.resume()
    assert rep.wait(120)
    rep.close()
    assert list_checkpoints(url) == [storage.checkpoint_name(2)]
    assert read_latest(url)[0] == storage.checkpoint_name(2)


@pytest.mark.filterwarnings("ignore:.*names 'step-000000004', which is not a committed")
def test_a_replaced_name_has_no_manifest_in_the_store_while_its_new_objects_are_put(
        tmp_path, url):
    """A name the store holds whose local checkpoint was replaced (a job killed before naming
    step 4 ``latest``; the next one saves step 4 again, from other batches): the store's old
    manifest is deleted before the first object of the new checkpoint is put, so that no
    reader finds the old manifest over data being rewritten (a load of the store's ``latest``
    falls back to step 2 meanwhile); then the store holds the new step 4, as on disk."""
    directory = str(tmp_path / "run")
    name = storage.checkpoint_name(4)
    committed_locally(directory, 4)
    remote.register(url, fast()["remote_options"])
    rep = replicate.Replicator(directory, url)
    rep.resume()
    assert rep.wait(120)
    rep.close()
    bucket, prefix = remote.bucket_of(url)
    old = bucket.get_small(f"{prefix}/{name}/manifest.json", 1 << 24)
    storage.commit.write_latest(directory, storage.checkpoint_name(2))  # (killed before it)
    seen = {}

    def fault(bucket, key):  # before the first object of the new step 4 is put
        seen[key] = bucket.head(f"{prefix}/{name}/manifest.json")
        seen["resolved"] = os.path.basename(storage.commit.resolve(url))

    remote.register(url, fast()["remote_options"], factory=faulty(name, fault, lambda b: None))
    model, opt = big_model()
    assert gockpt.load(directory, model, opt).step == 2
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, **fast())
    train(model, opt, ck, 4, start=2, seed=100)  # other batches than the first run's
    status = ck.wait_remote(BOUND_S)
    ck.close()
    assert status.uploaded == [name] and status.error is None
    with open(os.path.join(directory, name, "manifest.json"), "rb") as f:
        assert f.read() != old  # (replaced by another checkpoint)
    assert seen == {f"{prefix}/{name}/data.safetensors": None,
                    "resolved": storage.checkpoint_name(2)}
    assert read_latest(url)[0] == name
    H.assert_same(loads_equal(url)[1], loads_equal(directory)[1])


@pytest.mark.slow
def test_two_ranks_replicate_every_part_and_resume_from_the_store_bit_for_bit(
        tmp_path, url, monkeypatch):
    """DDP on 2 gloo ranks, gockpt-o, each replica writing its share: rank 0 uploads both
    parts; with the local directory gone, 2 fresh ranks load from the store and train on to
    the state of the uninterrupted run, bit for bit (ranks_worker's train and resume)."""
    monkeypatch.setenv("GOCKPT_TEST_REMOTE", url)
    directory = str(tmp_path / "ddp")
    run_ranks(directory, "train:gockpt-o:ddp", worker="ranks_worker")
    names = [storage.checkpoint_name(s) for s in ranks_worker.SAVE_AT]
    assert list_checkpoints(url) == names and read_latest(url)[0] == names[-1]
    bucket, prefix = remote.bucket_of(url)
    stored = sorted(o["path"][len(prefix) + 1:] for o in bucket.list_all(prefix)
                    if o["path"].startswith(f"{prefix}/{names[-1]}/"))
    assert stored == [f"{names[-1]}/{rel}" for rel in every_object(directory, names[-1])]
    assert any("rank-00001/" in rel for rel in stored)
    shutil.rmtree(directory)
    run_ranks(directory, "resume:gockpt-o:ddp", worker="ranks_worker")


@pytest.mark.slow
def test_each_rank_reads_only_its_slices_of_an_fsdp2_checkpoint_from_the_store(
        tmp_path, url, monkeypatch):
    """FSDP2 on 2 ranks replicated to the store; with the local directory gone, DCP loads it
    on 4 ranks through gockpt's reader from ``s3://``: the state at F bit for bit (the
    worker's check), and each rank fetched about a quarter of the stored bytes (ranged GETs of
    its slices, in whole checksum chunks) -- as on disk (test_many_ranks' DCP case)."""
    import re
    monkeypatch.setenv("GOCKPT_TEST_REMOTE", url)
    directory = str(tmp_path / "fsdp2")
    run_ranks(directory, "train:gockpt-o:fsdp2", world=2, worker="ranks_worker")
    path = storage.resolve(directory)
    stored = 0
    for part in storage.read_manifest(path)["ranks"]:
        for name, e in storage.read_manifest(os.path.join(path, part))["tensors"].items():
            if not is_small_tensor(name):
                stored += e["nbytes"]
    shutil.rmtree(directory)
    outs = run_ranks(directory, "dcp:gockpt-o:fsdp2", world=4, worker="ranks_worker")
    read = [int(re.search(r"read (\d+) bytes", out).group(1)) for out, _ in outs]
    assert sum(read) >= stored
    assert all(abs(r - stored / 4) <= 0.2 * stored / 4 for r in read), (read, stored)


@pytest.mark.slow
def test_a_dcp_save_on_two_ranks_is_uploaded_whole_and_loads_from_the_store(
        tmp_path, url, monkeypatch):
    """dcp.save through GockptWriter(remote=...) on 2 gloo ranks (DDP): the coordinator
    uploads every rank's part, the other rank starts no uploads (ranks_worker's dcpsave);
    with the local directory gone, gockpt.load on 2 fresh ranks reads the store and gets the
    state the saving run gathered, bit for bit (its dcpgload)."""
    monkeypatch.setenv("GOCKPT_TEST_REMOTE", url)
    directory = str(tmp_path / "ddp")
    run_ranks(directory, "dcpsave:adamw:ddp", world=2, worker="ranks_worker")
    name = storage.checkpoint_name(ranks_worker.SAVE_AT[-1])
    assert list_checkpoints(url) == [name] and read_latest(url)[0] == name
    bucket, prefix = remote.bucket_of(url)
    stored = sorted(o["path"][len(prefix) + 1:] for o in bucket.list_all(prefix)
                    if o["path"].startswith(f"{prefix}/{name}/"))
    assert stored == [f"{name}/{rel}" for rel in every_object(directory, name)]
    assert any("rank-00001/" in rel for rel in stored)
    shutil.rmtree(directory)
    run_ranks(directory, "dcpgload:adamw:ddp", world=2, worker="ranks_worker")


def loads_equal_small(source):
    model, opt, sched = H.build()
    gockpt.load(source, model, opt, scheduler=sched)
    return H.snapshot(model, opt, sched)


# ------------------------------------------------------------------------------- tools

def test_the_tools_take_s3_urls(tmp_path, url, capsys):
    """gockpt list / inspect / verify / export on the store, as on a directory; a damaged
    object is exit status 1 naming the tensor."""
    directory = str(tmp_path / "run")
    model, opt = big_model()
    ck = gockpt.Checkpointer(model, opt, directory, interval=2, remote=url, remote_wait_s=None,
                             **fast())
    train(model, opt, ck, 4)
    ck.close()
    rc, out, _ = run(capsys, "list", url)
    assert rc == 0 and storage.checkpoint_name(2) in out and storage.checkpoint_name(4) in out
    rc, out, _ = run(capsys, "inspect", url)
    assert rc == 0 and "0.weight" in out
    # the URL as written (not a local path under the working directory), its commit's date
    assert f"checkpoint   {url}/{storage.checkpoint_name(4)}" in out, out
    assert "written      20" in out, out
    rc, out, _ = run(capsys, "verify", url)
    assert rc == 0 and f"OK       {url}/{storage.checkpoint_name(4)} (step 4)" in out, out
    exported = str(tmp_path / "model.safetensors")
    rc, out, err = run(capsys, "export", url, "--to", "safetensors", exported)
    assert rc == 0, err
    from safetensors.torch import load_file
    assert torch.equal(load_file(exported)["0.weight"], model[0].weight.detach())
    name = storage.checkpoint_name(4)
    bucket, key = remote.bucket_of(f"{url}/{name}/data.safetensors")
    data = bytearray(bytes(bucket.get_small(key, 1 << 30)))
    entry = storage.read_manifest(os.path.join(directory, name))["tensors"]["optim/0/exp_avg"]
    data[entry["offset"] + 11] ^= 1
    bucket.put_bytes(key, bytes(data))
    rc, out, err = run(capsys, "verify", url)
    assert rc == 1 and "optim/0/exp_avg" in out + err


# ------------------------------------------------------------------------------- refusals

def test_remote_urls_and_options_are_checked_when_the_checkpointer_is_built(tmp_path):
    for bad in ("s3://", "s3:///x", "s3://b/../x", "s3://b//x"):
        with pytest.raises(ConfigError, match="not a valid s3://bucket/prefix URL"):
            gockpt.Config(directory=str(tmp_path), remote=bad)
    with pytest.raises(ConfigError, match="must be a local path"):
        gockpt.Config(directory="s3://bucket/run")
    with pytest.raises(ConfigError, match="unknown option"):
        gockpt.Config(directory=str(tmp_path), remote="s3://b/x", remote_options={"speed": 1})
    with pytest.raises(ConfigError, match="part_bytes must be an int >= 5 MiB"):
        gockpt.Config(directory=str(tmp_path), remote="s3://b/x",
                      remote_options={"part_bytes": 1024})


def test_credentials_the_store_refuses_are_named_with_the_settings_to_check(tmp_path):
    """A store that checks credentials (403 for a wrong secret): the error says which
    settings to look at, not only the store's own text."""
    iam = S3Server(str(tmp_path / "iam"), iam=True)
    iam.start()
    try:
        url = "s3://some-bucket/runs/one"
        remote.register(url, {**iam.options(), "secret_access_key": "not-the-secret",
                              "allow_http": True, "max_retries": 0})
        model, opt = big_model()
        with pytest.raises(StorageError, match="403 Forbidden.*the store refused these "
                           "credentials for this bucket: check the access key and secret "
                           r"\(Config.remote_options access_key_id"):
            gockpt.load(url, model, opt)
    finally:
        iam.stop()


def test_loading_from_a_prefix_that_holds_no_checkpoint_says_so(url):
    model, opt = big_model()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint to load"):
        gockpt.load(url, model, opt)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint 'step-"):
        gockpt.load(url, model, opt, tag=storage.checkpoint_name(3))
