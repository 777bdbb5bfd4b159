"""Acceptance: the loaded checkpoint equals the live state at version F, bitwise, in every mode;
checkpointing does not change training; bad input gets a gockpt error."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import gockpt
from gockpt import storage

from tests._support import harness as H

# Patches the CPU device's own code, which the simulated asynchronous device
# (GOCKPT_SIMULATED_DEVICE, as .ci/run sets it for a second pass) does not run.
HOST_DEVICE_ONLY = pytest.mark.skipif(bool(os.environ.get("GOCKPT_SIMULATED_DEVICE")),
                                      reason="patches the CPU device's code")

MODES_K = [("sync", None), ("async", None), ("async-o", None)] + \
    [(m, k) for m in ("gockpt", "gockpt-o") for k in (1, 2, 3, 7)]


def run_and_snapshot(tmp_path, mode, k, *, impl="single", optim="adamw", scaler=None,
                     inf_steps=(), force=(), interval=8, steps=20, block_bytes=512,
                     group_by_group=False, clip=None, **options):
    """Train with a checkpoint every ``interval`` steps (the replay modes copy over the K steps
    up to it) and forced at ``force``; snapshot the live state at every F."""
    H.seed_all(0)
    model, opt, sched = H.build(optim=optim, impl=impl)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=k,
                             scheduler=sched, block_bytes=block_bytes, self_check=1.0,
                             interval=interval, **options)
    pending, snaps, handles = [], {}, []

    def on_boundary(step, handle):
        if handle is not None:
            pending.append(handle)
            handles.append(handle)
        for h in list(pending):
            if step == h.final_step:
                snaps[step] = H.snapshot(model, opt, sched)
                pending.remove(h)

    H.train_steps(model, opt, sched, 0, steps, ck, scaler=scaler, inf_steps=inf_steps,
                  on_boundary=on_boundary, force=set(force), group_by_group=group_by_group,
                  clip=clip)
    ck.close()
    return snaps, handles


def load_snapshot(tmp_path, tag, *, impl="single", optim="adamw"):
    model, opt, sched = H.build(seed=123, optim=optim, impl=impl)
    restored = gockpt.load(str(tmp_path), model, opt, scheduler=sched, tag=tag)
    return restored, H.snapshot(model, opt, sched)


@pytest.mark.parametrize("mode,k", MODES_K)
def test_checkpoint_is_live_state_at_F(tmp_path, mode, k):
    snaps, handles = run_and_snapshot(tmp_path, mode, k)
    assert len(handles) == 2 and all(h.done() and h.error is None for h in handles)
    assert [h.final_step for h in handles] == [8, 16]  # the steps asked for, in every mode
    expected_k = 1 if mode in ("sync", "async", "async-o") else k
    metrics = gockpt.metrics.read(str(tmp_path))
    assert [(m["start_step"], m["overlap_steps"]) for m in metrics] == \
        [(8 - expected_k + 1, expected_k), (16 - expected_k + 1, expected_k)]
    for h in handles:
        restored, state = load_snapshot(tmp_path, os.path.basename(h.path))
        assert restored.step == h.final_step
        assert restored.extra_state == {"epoch": (h.final_step - 1) // 5, "note": "x"}
        H.assert_same(snaps[h.final_step], state)
    # the latest pointer names the newest checkpoint
    restored, _ = load_snapshot(tmp_path, None)
    assert restored.step == handles[-1].final_step


@pytest.mark.parametrize("mode,k", [("async-o", None), ("gockpt", 2), ("gockpt-o", 3)])
def test_an_optimizer_stepped_group_by_group_is_checkpointed_at_F(tmp_path, mode, k):
    # DeepSpeed's ZeRO 1/2 step their base optimizer once per param group, narrowing
    # param_groups for each call: that is one training step, not a changed optimizer.
    snaps, handles = run_and_snapshot(tmp_path, mode, k, group_by_group=True)
    assert len(handles) == 2 and all(h.done() and h.error is None for h in handles)
    for h in handles:
        restored, state = load_snapshot(tmp_path, os.path.basename(h.path))
        H.assert_same(snaps[h.final_step], state)


class Bf16Clip:
    """Gradients as DeepSpeed's ZeRO 1/2 in bf16 hand them to the optimizer: bf16 values made
    float32, then multiplied by one clipping coefficient (the grad_multiplier)."""

    def __init__(self):
        self.coef = None

    def __call__(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.copy_(g.bfloat16().float())
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(self.coef)


@pytest.mark.parametrize("mode,k,bf16_grads", [("gockpt-o", 3, True), ("gockpt", 2, True),
                                                ("gockpt-o", 3, False)])
def test_bf16_gradient_transport(tmp_path, mode, k, bf16_grads):
    # bf16 values times one coefficient cross as 2-byte images + the coefficient; anything
    # else is found not exact on the device and crosses in fp32: bitwise either way.
    clip = Bf16Clip()
    snaps, handles = run_and_snapshot(tmp_path, mode, k, grad_transport="bf16",
                                      grad_multiplier=lambda: clip.coef,
                                      clip=clip if bf16_grads else None)
    for h in handles:
        restored, state = load_snapshot(tmp_path, os.path.basename(h.path))
        H.assert_same(snaps[h.final_step], state)
    metrics = [m for m in gockpt.metrics.read(str(tmp_path)) if m["mode"] == mode]
    assert len(metrics) == 2
    for m in metrics:
        assert m["grad_transport"] == ("bf16" if bf16_grads else "fp32")
        assert m["grad_steps"] == k - 1 and m["grad_bytes"] > 0
        assert m["grad_bytes_per_step"] == m["grad_bytes"] // (k - 1)
    if bf16_grads:  # the same run in fp32 carries twice the bytes
        clip = Bf16Clip()
        run_and_snapshot(tmp_path / "fp32", mode, k, clip=clip)
        fp32 = gockpt.metrics.read(str(tmp_path / "fp32"))
        assert [m["grad_bytes"] for m in fp32] == [2 * m["grad_bytes"] for m in metrics]
        assert [m["grad_transport"] for m in fp32] == ["fp32", "fp32"]


def test_bf16_images_are_copied_after_the_states_copies(tmp_path, monkeypatch):
    # the images are private to gockpt (nothing in training waits for them but the replay),
    # so they trail the state's copies, which the next update_begin waits for: queued at
    # SNAPSHOT priority, not GRADIENT's (which put the last group behind them: DeepSpeed's
    # update_begin waited 7-10 ms at the end of a window over the emulated link)
    from gockpt.capture.transfer import SNAPSHOT, CopyEngine
    queued, submit = [], CopyEngine.submit_group

    def recorded(engine, group, priority):
        queued.append((type(group).__name__, priority))
        return submit(engine, group, priority)
    monkeypatch.setattr(CopyEngine, "submit_group", recorded)
    clip = Bf16Clip()
    snaps, handles = run_and_snapshot(tmp_path, "gockpt-o", 3, grad_transport="bf16",
                                      grad_multiplier=lambda: clip.coef, clip=clip)
    images = [priority for name, priority in queued if name == "_GradientCopies"]
    assert len(images) == 2 * (3 - 1) and set(images) == {SNAPSHOT}
    assert [m["grad_transport"] for m in gockpt.metrics.read(str(tmp_path))] == ["bf16"] * 2
    _, state = load_snapshot(tmp_path, None)
    H.assert_same(snaps[handles[-1].final_step], state)


@pytest.mark.parametrize("optim", ["adamw", "adam"])
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_every_adam_implementation_replays_bitwise(tmp_path, optim, impl):
    snaps, handles = run_and_snapshot(tmp_path, "gockpt-o", 3, impl=impl, optim=optim,
                                      interval=5, steps=12)
    _, state = load_snapshot(tmp_path, None, impl=impl, optim=optim)
    H.assert_same(snaps[handles[-1].final_step], state)


@pytest.mark.parametrize("mode,k,impl", [("gockpt", 3, "single"), ("gockpt-o", 3, "single"),
                                         ("gockpt-o", 3, "fused"), ("async-o", None, "single")])
def test_fp16_grad_scaler_with_a_skipped_step(tmp_path, mode, k, impl):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    # step 6 (0-based) overflows: GradScaler skips optimizer.step() and lowers the scale;
    # it lies inside the window of the checkpoint of step 8 (boundaries 6 to 8).
    snaps, handles = run_and_snapshot(tmp_path, mode, k, scaler=scaler, inf_steps={6},
                                      interval=8, steps=12, impl=impl)
    assert scaler.get_scale() < 2.0 ** 10  # the skip really happened
    _, state = load_snapshot(tmp_path, None, impl=impl)
    H.assert_same(snaps[handles[0].final_step], state)


def test_no_interference_with_training(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    ref_losses = H.train_steps(model, opt, sched, 0, 20)
    ref = H.snapshot(model, opt, sched)

    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             scheduler=sched, block_bytes=512, interval=6)
    losses = H.train_steps(model, opt, sched, 0, 20, ck)
    ck.close()
    assert storage.list_checkpoints(str(tmp_path))  # checkpoints were really taken
    assert losses == ref_losses
    H.assert_same(ref, H.snapshot(model, opt, sched))


def test_auto_overlap_steps_and_metrics(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), scheduler=sched, block_bytes=512,
                             interval=8)
    H.train_steps(model, opt, sched, 0, 20, ck)
    ck.close()
    records = gockpt.metrics.read(str(tmp_path))
    assert [r["final_step"] for r in records] == [8, 16]
    for r in records:
        assert 1 <= r["overlap_steps"] <= 8
        assert r["start_step"] == r["final_step"] - r["overlap_steps"] + 1
        assert r["mode"] == "gockpt-o" and r["state_bytes"] > 0
        assert r["time_to_durable_s"] >= r["persist_s"] > 0
        assert set(r["blocked_by_hook_s"]) <= {"save_checkpoint", "save_checkpoint_busy_wait",
                                              "update_begin", "backward_begin",
                                              "optimizer_step", "zero_grad"}


def test_host_memory_is_reused_across_checkpoints(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=2,
                             scheduler=sched, block_bytes=512, interval=4)
    seen = []
    H.train_steps(model, opt, sched, 0, 7, ck)
    seen.append((ck.host_bytes, [b.data_ptr() for b in ck.host.param]))
    H.train_steps(model, opt, sched, 7, 15, ck)
    seen.append((ck.host_bytes, [b.data_ptr() for b in ck.host.param]))
    ck.close()
    assert seen[0] == seen[1]
    assert len(storage.list_checkpoints(str(tmp_path))) == 3


def test_interval_auto_recomputes_from_measured_stall(tmp_path, caplog):
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched,
                             interval="auto", mtbf=3600.0, first_auto_step=3)
    with caplog.at_level("INFO", logger="gockpt"):
        H.train_steps(model, opt, sched, 0, 6, ck)
        ck.wait()
        H.train_steps(model, opt, sched, 6, 8, ck)
    ck.close()
    records = gockpt.metrics.read(str(tmp_path))
    assert records[0]["start_step"] == 3
    from gockpt.interval import auto_interval
    assert ck.schedule.auto_interval == auto_interval(
        records[0]["blocked_s"], ck.schedule.auto_inputs[1], 3600.0)
    assert any("checkpoint interval" in r.message for r in caplog.records)


def test_interval_auto_needs_mtbf(tmp_path):
    model, opt, _ = H.build()
    with pytest.raises(gockpt.ConfigError, match="mtbf"):
        gockpt.Checkpointer(model, opt, str(tmp_path), interval="auto")


def test_keep_last_retention(tmp_path):
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched,
                             interval=2, keep_last=2)
    H.train_steps(model, opt, sched, 0, 10, ck)
    ck.close()
    assert storage.list_checkpoints(str(tmp_path)) == ["step-000000008", "step-000000010"]
    assert os.path.basename(storage.resolve(str(tmp_path))) == "step-000000010"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


@pytest.mark.parametrize("mode", ["async-o", "gockpt-o"])
def test_a_checkpoint_named_by_the_caller(tmp_path, mode):
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=2)
    with pytest.raises(gockpt.ConfigError, match="checkpoint name"):
        ck.save_checkpoint(0, force=True, name="../escape")
    ck.save_checkpoint(0)  # the refused call changed nothing
    handles = []
    H.train_steps(model, opt, sched, 0, 4, ck, names={1: "global_step2"},
                  on_boundary=lambda step, h: h and handles.append(h))
    handles[0].wait()
    assert storage.list_checkpoints(str(tmp_path)) == ["global_step2"]
    assert storage.commit.read_latest(str(tmp_path))[0] == "global_step2"
    with pytest.raises(gockpt.ConfigError, match="exists"):
        H.train_steps(model, opt, sched, 4, 5, ck, names={5: "global_step2"})
    ck.close()


def test_a_tag_committed_beyond_latest_is_replaced_by_the_next_save_of_it(tmp_path):
    """A run killed between the commit of ``global_step4`` and ``latest``'s update resumes
    from ``global_step2`` and saves ``global_step4`` again: the old one is replaced, and
    ``latest`` names the new one."""
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=2)
    handles = []
    H.train_steps(model, opt, sched, 0, 4, ck, names={2: "global_step2", 4: "global_step4"},
                  on_boundary=lambda step, h: h and handles.append(h))
    for h in handles:
        h.wait()
    storage.commit.write_latest(str(tmp_path), "global_step2")  # (as if killed before it)
    H.train_steps(model, opt, sched, 4, 6, ck, names={6: "global_step4"},
                  on_boundary=lambda step, h: h and handles.append(h))
    handles[-1].wait()
    ck.close()
    assert handles[-1].error is None
    assert storage.list_checkpoints(str(tmp_path)) == ["global_step2", "global_step4"]
    assert gockpt.load(str(tmp_path), *H.build(seed=123)[:2]).step == 6


@HOST_DEVICE_ONLY
@pytest.mark.parametrize("mode", ["async-o", "gockpt-o"])
def test_the_first_checkpoint_allocates_no_staging_on_the_training_thread(tmp_path, monkeypatch,
                                                                           mode):
    # Pinned host memory takes seconds per GB on a GPU machine: it is allocated on a thread
    # started at construction, with the state keys expected (the adapter's, or Adam's).
    from gockpt.capture.device import HostDevice
    threads, device_memory = [], []
    empty, device_arena = HostDevice.empty, HostDevice.device_arena

    def recording(self, numel, dtype):
        if not device_memory:  # host staging, not the CPU stand-in for device memory
            threads.append(threading.current_thread().name)
        return empty(self, numel, dtype)

    def not_host_staging(self, dtype, sizes):
        device_memory.append(True)
        try:
            return device_arena(self, dtype, sizes)
        finally:
            device_memory.pop()
    monkeypatch.setattr(HostDevice, "empty", recording)
    monkeypatch.setattr(HostDevice, "device_arena", not_host_staging)
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=2,
                             scheduler=sched, block_bytes=512, interval=3)
    H.train_steps(model, opt, sched, 0, 5, ck)
    ck.close()
    assert threads and set(threads) == {"gockpt-staging"}, threads
    assert [(m["start_step"], m["final_step"]) for m in gockpt.metrics.read(str(tmp_path))] \
        == [(3 if mode == "async-o" else 2, 3)]


def test_host_memory_is_planned_and_capped(tmp_path):
    model, opt, _ = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=2)
    planned = ck.planned_host_bytes
    n_params = sum(p.numel() for p in model.parameters())
    assert planned >= n_params * 4 * 3
    ck.close()
    with pytest.raises(gockpt.ConfigError, match="max_host_bytes"):
        gockpt.Checkpointer(model, opt, str(tmp_path), max_host_bytes=planned - 1)


def test_the_cpus_gradient_snapshots_are_host_memory_planned_and_counted(tmp_path):
    # gockpt-o on the CPU copies each step's gradients from one of two snapshots (float32)
    # that live in host memory: planned against max_host_bytes and counted in host_bytes (a
    # device that queues the update behind the copies -- a GPU, the adversarial tier's
    # simulated one -- takes none)
    H.seed_all(0)
    model, opt, sched = H.build()
    n_params = sum(p.numel() for g in opt.param_groups for p in g["params"])  # the optimized
    ck = gockpt.Checkpointer(model, opt, str(tmp_path / "g"), mode="gockpt", overlap_steps=2)
    without = ck.planned_host_bytes  # gockpt: the update waits for the copies, no snapshot
    ck.close()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path / "o"), mode="gockpt-o", overlap_steps=2,
                             scheduler=sched, interval=3)
    snapshots = 2 * 4 * n_params if ck.device.overlap_needs_snapshot else 0
    assert ck.planned_host_bytes == without + snapshots
    H.train_steps(model, opt, sched, 0, 4, ck)  # a window: the snapshots are made
    assert ck.host_bytes == ck.staging.nbytes() + snapshots
    ck.close()
    if snapshots:
        with pytest.raises(gockpt.ConfigError, match="gradient snapshots"):
            gockpt.Checkpointer(model, opt, str(tmp_path / "o"), mode="gockpt-o",
                                max_host_bytes=without)


def test_blocks_are_streamed_to_storage_as_they_reach_F(tmp_path, monkeypatch):
    import threading
    from gockpt.replay import adapters as replay
    calls = []
    opened = threading.Event()
    real_apply = replay.AdamAdapter.apply

    def slow_final_apply(self, record, host, threads):
        # a large model's replay of step F outlasts the opening of the writer; here the
        # replay of step F waits for it, so that the interleaving is deterministic
        if record.final:
            assert opened.wait(60)
        real_apply(self, record, host, threads)

    from gockpt.storage import persist
    real_open = persist.Persister._open_writer

    def open_then_release(self, job):
        real_open(self, job)  # the writer is published to the job when this returns
        opened.set()

    class Recording(storage.CheckpointWriter):

        def write(self, name, tensor, *, start=0):
            calls.append((threading.current_thread().name, name))
            return super().write(name, tensor, start=start)

        def finish(self):
            calls.append((threading.current_thread().name, "finish"))
            return super().finish()

    monkeypatch.setattr(replay.AdamAdapter, "apply", slow_final_apply)
    monkeypatch.setattr(persist.Persister, "_open_writer", open_then_release)
    snaps, handles = run_and_snapshot(tmp_path, "gockpt-o", 3, interval=5, steps=8,
                                      storage_writer=Recording)
    threads_before_finish = {t for t, n in calls[:calls.index(("gockpt-persist", "finish"))]}
    # blocks finished by the replay of step F were written from the replay thread, before
    # the commit, and the checkpoint is still exactly the live state at F
    assert "gockpt-replay" in threads_before_finish
    _, state = load_snapshot(tmp_path, None)
    H.assert_same(snaps[handles[0].final_step], state)


class GatedWriter(storage.CheckpointWriter):
    """A storage plugin whose commit waits until the test opens ``gate``."""

    gate = None

    def finish(self):
        assert GatedWriter.gate.wait(60)
        return super().finish()


@pytest.mark.parametrize("policy", ["skip", "wait"])
def test_a_checkpoint_due_while_the_previous_persists(tmp_path, monkeypatch, policy):
    import threading
    GatedWriter.gate = threading.Event()
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched,
                             on_busy=policy, storage_writer=GatedWriter)
    handles = []
    H.train_steps(model, opt, sched, 0, 2, ck, force={2},
                  on_boundary=lambda s, h: h and handles.append(h))
    first = handles[0]
    assert not first.done()  # its write is held at the gate

    class OpensGateWhenWaitedOn(threading.Event):
        def wait(self, timeout=None):
            GatedWriter.gate.set()  # the new checkpoint waits for the old: let it finish
            return super().wait(timeout)

    first.progress.durable = OpensGateWhenWaitedOn()
    if policy == "skip":
        with pytest.warns(UserWarning, match="still persisting"):
            H.train_steps(model, opt, sched, 2, 3, ck, force={3},
                          on_boundary=lambda s, h: h and handles.append(h))
        assert len(handles) == 1
        GatedWriter.gate.set()
    else:
        H.train_steps(model, opt, sched, 2, 3, ck, force={3},
                      on_boundary=lambda s, h: h and handles.append(h))
        assert len(handles) == 2 and first.done()
    ck.close()
    records = gockpt.metrics.read(str(tmp_path))
    assert [r["final_step"] for r in records] == ([2] if policy == "skip" else [2, 3])
    if policy == "wait":
        assert records[1]["blocked_by_hook_s"]["save_checkpoint_busy_wait"] > 0


def test_a_wait_that_times_out_says_what_the_checkpoint_waits_for(tmp_path):
    GatedWriter.gate = threading.Event()  # its commit is held: it cannot be durable meanwhile
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="async", scheduler=sched,
                             storage_writer=GatedWriter)
    handles, snaps = [], {}
    H.train_steps(model, opt, sched, 0, 2, ck, force={2}, on_boundary=lambda s, h: h and (
        handles.append(h), snaps.update({s: H.snapshot(model, opt, sched)})))
    [h] = handles
    with pytest.raises(gockpt.WaitTimeoutError, match="step 2 is not durable after 0.05 s: "
                       "it waits for its writes and commit") as caught:
        h.wait(0.05)  # returned as if durable before
    assert caught.value.final_step == 2 and isinstance(caught.value, TimeoutError)
    assert not h.done()
    GatedWriter.gate.set()
    h.wait()  # the checkpoint went on
    ck.close()
    H.assert_same(snaps[2], load_snapshot(tmp_path, None)[1])


def _at_f_with_copies_left(tmp_path):
    """gockpt-o, K=3, a checkpoint announced at step 4, trained to step 4: its last copies
    are left to the loop's next update_begin."""
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             scheduler=sched)
    handles = []
    H.train_steps(model, opt, sched, 0, 4, ck, at=(4,), on_boundary=lambda s, h: h and
                  handles.append(h))
    [h] = handles
    assert ck._job is not None and ck._job.capturing  # (what the tests below are about)
    return model, opt, sched, ck, h, H.snapshot(model, opt, sched)


def test_a_wait_from_another_thread_waits_for_the_loop_and_says_so_at_its_timeout(tmp_path):
    model, opt, sched, ck, h, at_f = _at_f_with_copies_left(tmp_path)
    outcome = {}

    def waiter(timeout):
        try:
            h.wait(timeout)
            outcome[timeout] = "durable"
        except gockpt.GockptError as exc:
            outcome[timeout] = exc

    t = threading.Thread(target=waiter, args=(0.05,))
    t.start()
    t.join(60)
    assert isinstance(outcome[0.05], gockpt.WaitTimeoutError), outcome
    assert "its last copies, which the training loop's thread ('MainThread') makes at its " \
        "next update_begin() or close()" in str(outcome[0.05])
    t = threading.Thread(target=waiter, args=(None,))
    t.start()
    H.train_steps(model, opt, sched, 4, 5, ck)  # the loop's next update_begin copies the rest
    t.join(60)
    assert outcome[None] == "durable"
    ck.close()
    H.assert_same(at_f, load_snapshot(tmp_path, None)[1])


def test_a_wait_completes_the_checkpoint_once_the_loops_thread_has_ended(tmp_path):
    """The loop ran in a thread that ended without close() after the step asked for: a wait
    from another thread copies the rest itself instead of waiting for hooks that will never
    come (it hung until close() before)."""
    out = {}
    loop = threading.Thread(target=lambda: out.update(zip(
        ("model", "opt", "sched", "ck", "h", "at_f"), _at_f_with_copies_left(tmp_path))),
        name="training-loop")
    loop.start()
    loop.join(120)
    assert not loop.is_alive() and out["ck"]._job.capturing
    waiter = threading.Thread(target=out["h"].wait, kwargs={"timeout": 60})
    waiter.start()
    waiter.join(90)
    assert out["h"].done() and out["h"].error is None
    out["ck"].close()
    H.assert_same(out["at_f"], load_snapshot(tmp_path, None)[1])


def _python_calls_in_hooks(tmp_path, block_bytes: int) -> int:
    """Python calls made by gockpt's own code inside the hooks (and the optimizer-step hooks)
    during a steady-state checkpoint of gockpt-o K=2 (the second one: the first allocates)."""
    import sys
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(3)]
    model = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=2,
                             block_bytes=block_bytes, interval=3)
    calls, counting = [0], [False]

    def profile(frame, event, arg):
        if event in ("call", "c_call") and "/gockpt/" in frame.f_code.co_filename:
            calls[0] += 1

    def hook(fn, *args, **kwargs):
        if counting[0]:
            sys.setprofile(profile)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)

    ck.save_checkpoint(0)
    for step in range(8):
        counting[0] = step >= 4  # the window of the checkpoint of step 6 (boundaries 5, 6)
        hook(ck.backward_begin)
        sum((p * p).sum() for p in params).backward()
        hook(ck.update_begin)
        hook(opt.step)
        opt.zero_grad()
        hook(ck.save_checkpoint, step + 1)
    ck.close()
    return calls[0]


def test_hook_work_does_not_grow_with_the_number_of_blocks(tmp_path):
    # 12 blocks against 768 (3 parameters of 256 KiB in 64 KiB or 1 KiB blocks): the hooks do
    # array work per group, so the Python calls they make stay the same; a loop over blocks
    # would add hundreds.
    few = _python_calls_in_hooks(tmp_path / "few", 1 << 16)
    many = _python_calls_in_hooks(tmp_path / "many", 1 << 10)
    assert few > 100  # the profile saw the hooks
    assert many - few < 50, (few, many)


# ------------------------------------------------------------------ the step asked for

def _saves(tmp_path, mode, k, steps, **kw):
    """Train ``steps`` steps; every checkpoint's handle and the live state at its step."""
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=k,
                             scheduler=sched, block_bytes=512, **kw.pop("options", {}))
    snaps, handles = {}, []

    def on_boundary(step, h):
        if h is not None:
            assert h.final_step == step  # the handle comes back at the step it is for
            handles.append(h)
            snaps[step] = H.snapshot(model, opt, sched)

    H.train_steps(model, opt, sched, 0, steps, ck, on_boundary=on_boundary,
                  extra=lambda s: {"data_pos": 100 * s}, **kw)
    return ck, snaps, handles


def _assert_each_is_its_step(tmp_path, snaps, handles):
    for h in handles:
        restored, state = load_snapshot(tmp_path, os.path.basename(h.path))
        assert restored.step == h.final_step
        assert restored.extra_state == {"data_pos": 100 * h.final_step}  # values given there
        H.assert_same(snaps[h.final_step], state)


@pytest.mark.parametrize("mode,k", MODES_K)
def test_a_forced_save_is_the_state_of_its_step(tmp_path, mode, k):
    ck, snaps, handles = _saves(tmp_path, mode, k, 9, force={5})
    ck.close()
    assert [h.final_step for h in handles] == [5]
    assert [(m["start_step"], m["overlap_steps"]) for m in
            gockpt.metrics.read(str(tmp_path))] == [(5, 1)]  # without notice: copied at once
    _assert_each_is_its_step(tmp_path, snaps, handles)


@pytest.mark.parametrize("mode,k", [("async", None), ("async-o", None), ("gockpt", 3),
                                    ("gockpt-o", 3)])
@pytest.mark.parametrize("how", ["handle.wait", "ck.wait", "close"])
def test_a_save_at_the_last_step_completes(tmp_path, mode, k, how):
    """Training ends right after the step asked for: nothing will carry its last copies,
    the wait does them; interval-planned and forced alike."""
    ck, snaps, handles = _saves(tmp_path, mode, k, 8, options={"interval": 4})
    assert [h.final_step for h in handles] == [4, 8]
    if how == "handle.wait":
        handles[-1].wait()
    elif how == "ck.wait":
        ck.wait()
    ck.close()
    assert handles[-1].done() and handles[-1].error is None
    assert storage.list_checkpoints(str(tmp_path)) == ["step-000000004", "step-000000008"]
    _assert_each_is_its_step(tmp_path, snaps, handles)


def test_a_forced_save_at_the_last_step_completes_on_handle_wait(tmp_path):
    ck, snaps, handles = _saves(tmp_path, "gockpt-o", 3, 6, force={6})
    handles[0].wait()  # from the training thread: copied now, not waiting for a next step
    assert handles[0].done() and storage.list_checkpoints(str(tmp_path)) == ["step-000000006"]
    ck.close()
    _assert_each_is_its_step(tmp_path, snaps, handles)


def test_the_spacing_of_forced_saves_is_learned(tmp_path):
    # The first two saves come without notice; from the third on, the window of the next
    # one starts K - 1 steps early. A save at another step drops the planned window
    # (nothing of it is visible) and is copied at once.
    ck, snaps, handles = _saves(tmp_path, "gockpt-o", 2, 20, force={3, 6, 9, 12, 14, 19})
    ck.close()
    assert [h.final_step for h in handles] == [3, 6, 9, 12, 14, 19]
    assert [(m["final_step"], m["overlap_steps"]) for m in
            gockpt.metrics.read(str(tmp_path))] == \
        [(3, 1), (6, 1), (9, 2), (12, 2), (14, 1), (19, 1)]
    assert storage.list_checkpoints(str(tmp_path)) == \
        [storage.checkpoint_name(h.final_step) for h in handles]
    _assert_each_is_its_step(tmp_path, snaps, handles)


def test_a_k_that_grows_at_the_windows_start_still_starts_the_window(tmp_path, monkeypatch):
    # K measured 3 up to boundary 5 and 4 from boundary 6 on (a slower step measured there):
    # the window of the checkpoint announced at step 8 was due to start at boundary 6 with
    # K = 3, and K = 4 there points at step 9. It starts there all the same, with the 3 steps
    # left, instead of being copied at once at step 8 as a save without notice.
    from gockpt.checkpointer import Checkpointer
    from gockpt.schedule import Schedule
    at = {"step": 0}
    start_window = Checkpointer._maybe_start_window

    def spy(self, step):
        at["step"] = step
        return start_window(self, step)
    monkeypatch.setattr(Checkpointer, "_maybe_start_window", spy)
    monkeypatch.setattr(Schedule, "measured_k",
                        lambda self, plan, bandwidth, replays: 3 if at["step"] < 6 else 4)
    ck, snaps, handles = _saves(tmp_path, "gockpt-o", None, 10, at=(8,))
    ck.close()
    assert [(m["final_step"], m["overlap_steps"], m["start_step"]) for m in
            gockpt.metrics.read(str(tmp_path))] == [(8, 3, 6)]
    _assert_each_is_its_step(tmp_path, snaps, handles)


def test_an_explicit_k_is_honoured_for_a_single_block_of_state(tmp_path):
    # one flat parameter of 3000 elements is one 4 MiB block: the blocks are cut for K = 3
    torch.manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(3000))
    model = torch.nn.ParameterList([flat])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             interval=5)
    assert len(ck.plan.blocks) >= 3
    for step in range(5):
        ck.backward_begin()
        (flat * torch.arange(3000.0)).sin().sum().backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)
    expected = H.snapshot(model, opt)
    ck.close()
    assert [m["overlap_steps"] for m in gockpt.metrics.read(str(tmp_path))] == [3]
    fresh = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(3000))])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    gockpt.load(str(tmp_path), fresh, fresh_opt, restore_rng=False)
    got = H.snapshot(fresh, fresh_opt)
    for key in ("model", "optimizer"):
        assert gockpt.testing.first_difference(expected[key], got[key], key) is None
    with pytest.raises(gockpt.ConfigError, match="overlap_steps=4 needs at least 4 blocks"):
        tiny = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(3))])
        gockpt.Checkpointer(tiny, torch.optim.AdamW(tiny.parameters()), str(tmp_path / "t"),
                            mode="gockpt-o", overlap_steps=4)


def test_a_step_the_replay_cannot_follow_falls_back_to_copying_at_the_step(tmp_path):
    # GradScaler.step on a fused AdamW without unscale_: the optimizer unscales inside its
    # kernel, which the replay does not reproduce. Training must go on, and each checkpoint
    # still be its step's state: the window's copies are refused with a warning, and that
    # step and the later ones are copied at their step (K = 1), as async-o does.
    H.seed_all(0)
    model, opt, sched = H.build(impl="fused")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             scheduler=sched, block_bytes=512, interval=6)
    snaps = {}
    with pytest.warns(UserWarning, match="the replay cannot follow this optimizer .*GradScaler"):
        for step in range(14):
            x, y = H.batch(step)
            loss = torch.nn.functional.cross_entropy(model(x, step), y)
            ck.backward_begin()
            scaler.scale(loss).backward()
            ck.update_begin()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            ck.save_checkpoint(step + 1)
            snaps[step + 1] = H.snapshot(model, opt, sched)
        ck.close()
    records = gockpt.metrics.read(str(tmp_path))
    assert [(m["final_step"], m["overlap_steps"]) for m in records] == [(6, 1), (12, 1)]
    for step in (6, 12):
        m2, o2, s2 = H.build(seed=7, impl="fused")
        gockpt.load(str(tmp_path), m2, o2, scheduler=s2, tag=f"step-{step:09d}")
        H.assert_same(snaps[step], H.snapshot(m2, o2, s2))


def test_checkpoints_leave_no_reference_cycles_behind(tmp_path):
    """A checkpoint that has ended is freed by reference counting: nothing of it is left in a
    reference cycle for Python's garbage collector (a job, its handle's wait callbacks and
    the job were one: thousands of objects per checkpoint of 1,000 tensors, whose full
    collections stalled the training thread)."""
    import gc
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=3,
                             interval=4, scheduler=sched)

    def steps(start, stop):  # (checkpoints at the boundaries start + 1 .. stop)
        H.train_steps(model, opt, sched, start, stop, ck)
        ck.wait()
    steps(0, 8)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # (what the collector finds unreachable: kept to be looked at)
    try:
        steps(8, 24)  # four more checkpoints, each asked for, waited for and ended
        gc.collect()
        # gockpt's own (what else this process's threads leave is not this test's)
        left = [type(o).__name__ for o in gc.garbage
                if type(o).__module__.startswith("gockpt.")]
        assert left == [], sorted(set(left))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        ck.close()
    assert [m["final_step"] for m in gockpt.metrics.read(str(tmp_path))] == [4, 8, 12, 16, 20, 24]
