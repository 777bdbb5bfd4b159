"""gockpt.storage.persist: the persist thread streams blocks as they reach F, writes each once,
commits the typed manifest, and on a storage failure fails the job leaving nothing behind."""

from __future__ import annotations

import errno
import json
import os
import threading
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from gockpt import storage
from gockpt.core import metrics
from gockpt.capture.copies import Capture
from gockpt.capture.device import HostDevice
from gockpt.core.planning import build_plan
from gockpt.core.staging import HostCopy
from gockpt.capture.transfer import CopyEngine
from gockpt.core.config import Config
from gockpt.core.errors import CheckpointFailedError, StorageError
from gockpt.core.job import Job, State
from gockpt.pipeline import freeze_small_state
from gockpt.storage import manifest as M
from gockpt.storage import schema as S
from gockpt.storage.persist import Persister
from gockpt.storage.ranks import Ranks

from tests._support import harness as H


class Recording(storage.CheckpointWriter):
    """A storage plugin that logs what it is asked to do (and may fail at ``fail_at``)."""

    log = []
    fail_at = None
    fail_once = False
    expected_elements = None  # set by the test: elements of one checkpoint's stored tensors
    all_written = None        # threading.Event set when that many were queued

    def _maybe_fail(self, what):
        if Recording.fail_at == what:
            if Recording.fail_once:
                Recording.fail_at = None
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {what})")

    def begin(self, layout):
        Recording.log.append(("begin", self.name))
        self._maybe_fail("begin")
        return super().begin(layout)

    def write(self, name, tensor, *, start=0):
        Recording.log.append(("write", name, start, tensor.numel()))
        self._maybe_fail("write")
        if not name.startswith("small/"):
            self._maybe_fail("write of a block")
        super().write(name, tensor, start=start)
        written = sum(e[3] for e in Recording.log if e[0] == "write")
        if Recording.all_written is not None and written == Recording.expected_elements:
            Recording.all_written.set()

    def write_tensors(self, tensors):
        Recording.log.append(("write_tensors", self.name))
        return super().write_tensors(tensors)

    def finish(self):
        Recording.log.append(("finish", self.name))
        self._maybe_fail("finish")
        return super().finish()

    def commit(self, manifest, *, update_latest=True):
        Recording.log.append(("commit", self.name))
        self._maybe_fail("commit")
        return super().commit(manifest, update_latest=update_latest)


@pytest.fixture
def rig(tmp_path, monkeypatch):
    monkeypatch.setattr(Recording, "log", [])
    monkeypatch.setattr(Recording, "fail_at", None)
    monkeypatch.setattr(Recording, "fail_once", False)
    monkeypatch.setattr(Recording, "all_written", None)
    monkeypatch.setattr(Recording, "expected_elements", None)
    H.seed_all(0)
    model, opt, sched = H.build()
    x, y = H.batch(1)
    torch.nn.functional.cross_entropy(model(x, 1), y).backward()
    opt.step()  # every trained parameter has optimizer state
    plan = build_plan(model, opt, 1024)
    engine = CopyEngine(HostDevice())
    capture = Capture(model, opt, sched, engine, None)
    host = HostCopy(plan, HostDevice())
    durable = []
    made = []

    def persister(**options):
        config = Config(directory=str(tmp_path), mode="async", storage_writer=Recording,
                        **options)
        p = Persister(config, plan, Ranks(), "AdamW", step_time=lambda: 0.25,
                      host_bytes=lambda: 1234, on_durable=durable.append)
        made.append(p)
        return p

    yield SimpleNamespace(model=model, opt=opt, plan=plan, capture=capture, host=host,
                          dir=str(tmp_path), durable=durable, persister=persister)
    for p in made:
        p.close()
    engine.close()


def captured_job(rig, start_step, k=2):
    """A job whose blocks are all captured and whose small state is frozen (version F)."""
    rig.capture.declare_state_keys(rig.host)
    job = Job(start_step, k, start_step, rig.plan.groups(k), "async",
              os.path.join(rig.dir, storage.checkpoint_name(start_step + k - 1)), host=rig.host,
              plan=rig.plan)
    rig.capture.copy_rest(job)
    freeze_small_state(rig.capture, job, start_step + k - 1, {"note": "at F"})
    rig.capture.copy_at_f(job)  # the static slots
    job.accounts_closed.set()  # no hook will charge it any more: its metrics are final
    return job


def stored_elements(job, rig):
    """Elements of every stored tensor of ``job`` (parameters, aligned state, small state)."""
    n = sum(t.numel() for t in job.small_tensors.values())
    for b in rig.plan.blocks:
        s = rig.plan.slots[b.slot]
        n += b.numel * (1 + (0 if s.static else len(job.aligned.get(s.opt_index, ()))))
    return n


def written_once(log):
    """Whether no element of any stored tensor was queued twice."""
    spans = sorted((e[1], e[2], e[2] + e[3]) for e in log if e[0] == "write")
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def leftovers(directory):
    return [n for n in os.listdir(directory) if n.startswith(".tmp")]


def test_blocks_stream_before_commit_each_written_once(rig):
    p = rig.persister()
    job = captured_job(rig, 5)
    job.on_final = p.blocks_final
    Recording.expected_elements = stored_elements(job, rig)
    Recording.all_written = threading.Event()
    p.queue_open(job)
    p.blocks_final(job, job.capture.groups[0])  # the replay of step F finishes these blocks
    p.blocks_final(job, job.capture.groups[0][:1])  # told twice: written once
    p.queue_captured(job)  # the last group and the static blocks are at F too
    assert Recording.all_written.wait(30)
    # every block went to storage before the persist step was even queued
    assert [e[0] for e in Recording.log if e[0] != "write"] == ["begin"]
    job.staged()
    p.queue_persist(job)
    job.handle.wait(30)
    ops = [e[0] for e in Recording.log]
    assert ops[-2:] == ["finish", "commit"] and "write_tensors" not in ops
    assert written_once(Recording.log)
    assert sum(e[3] for e in Recording.log if e[0] == "write") == Recording.expected_elements
    assert job.state is State.DURABLE and rig.durable == [job]
    assert job.handle.path == os.path.join(rig.dir, "step-000000006")
    # what is stored is the host copy at F
    where, m = M.read(storage.resolve(rig.dir))
    stored = storage.read_tensors(where, m)
    for si, s in enumerate(rig.plan.slots):
        assert torch.equal(m.model.params[s.name].resolve(stored), s.param), s.name
        for key in job.aligned.get(s.opt_index, ()):
            assert torch.equal(m.optimizer.aligned[s.opt_index][key].resolve(stored),
                               rig.opt.state[s.param][key]), (s.name, key)


def test_commit_writes_the_typed_manifest_and_metrics(rig):
    p = rig.persister()
    job = captured_job(rig, 5, k=3)
    job.metrics.add_blocked("save_checkpoint", 0.125)
    job.staged()
    p.queue_persist(job)  # without streaming: one write_tensors at commit time
    job.handle.wait(30)
    assert ("write_tensors", "step-000000007") in Recording.log
    path = storage.resolve(rig.dir)
    assert os.path.basename(path) == "step-000000007"
    _, m = M.read(path)
    assert (m.step, m.start_step, m.mode, m.overlap_steps, m.rank, m.world_size) == \
        (7, 5, "async", 3, 0, 1)
    assert m.model.params == {s.name: M.TensorRef(S.param_tensor(s.name))
                              for s in rig.plan.slots}
    assert m.optimizer.cls == "AdamW"
    assert m.optimizer.aligned == {i: {k: M.TensorRef(S.optim_tensor(i, k)) for k in keys}
                                   for i, keys in job.aligned.items()}
    assert m.small == S.SmallSection(**json.loads(json.dumps(asdict(job.small))))
    assert m.small.decode("extra_state", storage.read_tensors(path, m)) == {"note": "at F"}
    assert m.metrics["blocked_by_hook_s"] == {"save_checkpoint": 0.125}
    assert (m.metrics["step_time_s"], m.metrics["host_bytes"]) == (0.25, 1234)
    records = metrics.read(rig.dir)
    assert [r["final_step"] for r in records] == [7]
    # the same record, but time_to_durable_s and time (when durable): the manifest is written
    # before the commit ends
    drop = {"time_to_durable_s", "time"}
    assert {k: v for k, v in records[0].items() if k not in drop} == \
        {k: v for k, v in m.metrics.items() if k not in drop}
    assert records[0]["time_to_durable_s"] >= m.metrics["time_to_durable_s"]
    assert records[0]["time"] >= m.metrics["time"]


@pytest.mark.parametrize("fail_at", [
    "begin", "write", "finish", "commit",
    "write of a block"])
def test_a_failing_plugin_fails_the_job_and_leaves_nothing(rig, fail_at):
    p = rig.persister()
    job = captured_job(rig, 5)
    job.on_final = p.blocks_final
    Recording.fail_at = fail_at
    p.queue_open(job)
    p.queue_captured(job)
    p.queue_persist(job)
    with pytest.raises(CheckpointFailedError, match="No space left") as info:
        job.handle.wait(30)
    p.close()  # the persist thread has finished everything queued
    assert isinstance(job.error, StorageError)
    assert isinstance(info.value.__cause__, StorageError)
    assert job.state is State.FAILED and rig.durable == []
    assert storage.list_checkpoints(rig.dir) == [] and leftovers(rig.dir) == []
    assert not os.path.exists(os.path.join(rig.dir, "latest"))
    assert not os.path.exists(os.path.join(rig.dir, "metrics.jsonl"))


def test_a_plugin_that_cannot_be_created_fails_the_job(rig, monkeypatch):
    def broken(root, name):
        raise OSError(errno.EACCES, "Permission denied")
    p = rig.persister()
    monkeypatch.setattr(p.config, "storage_writer", broken)
    job = captured_job(rig, 5)
    p.queue_persist(job)
    with pytest.raises(CheckpointFailedError, match="Permission denied"):
        job.handle.wait(30)
    assert isinstance(job.error, StorageError) and leftovers(rig.dir) == []


def test_a_job_that_already_failed_is_never_committed(rig):
    p = rig.persister()
    job = captured_job(rig, 5)
    job.on_final = p.blocks_final
    Recording.fail_at, Recording.fail_once = "begin", True
    p.queue_open(job)  # at the boundary of F: the writer fails to open (a transient error)
    job.staged()  # meanwhile the replay finished and, seeing no error yet, queued the persist
    p.queue_persist(job)
    with pytest.raises(CheckpointFailedError, match="No space left"):
        job.handle.wait(30)
    p.close()
    assert storage.list_checkpoints(rig.dir) == []  # committed although reported failed
    assert job.state is State.FAILED and rig.durable == []


def test_keep_last_deletes_only_older_committed_checkpoints(rig):
    p = rig.persister(keep_last=2)
    own_tmp = os.path.join(rig.dir, f".tmp-step-000000099-{os.getpid()}-abcd1234")
    os.mkdir(own_tmp)  # a write in progress of this process
    os.mkdir(os.path.join(rig.dir, "notes"))  # not a checkpoint
    kept = []
    for start in (2, 4, 6):
        job = captured_job(rig, start, k=1)
        job.staged()
        p.queue_persist(job)
        job.handle.wait(30)
        kept.append(storage.list_checkpoints(rig.dir))
    assert kept == [["step-000000002"], ["step-000000002", "step-000000004"],
                    ["step-000000004", "step-000000006"]]
    assert os.path.basename(storage.resolve(rig.dir)) == "step-000000006"
    assert os.path.isdir(own_tmp) and os.path.isdir(os.path.join(rig.dir, "notes"))
    assert leftovers(rig.dir) == [os.path.basename(own_tmp)]
