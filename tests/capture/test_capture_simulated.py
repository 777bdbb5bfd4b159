"""gockpt.capture.simulated: the CUDA path of the device layer run on CPU tensors, with copies
that run late (adversarial) or at once by priority (eager) -- whole checkpoints on it, proof
that it catches ordering bugs, and the device's own behaviour.

Self-contained: only gockpt, torch, pytest and the standard library."""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import warnings
import weakref

import pytest
import torch

import gockpt
import gockpt.checkpointer
from gockpt.capture.device import AsyncDevice, CudaDevice, Device, HostDevice
from gockpt.capture.devices import device_for
from gockpt.capture.simulated import POISON, SimEvent, SimulatedAsyncDevice
from gockpt.capture.transfer import GRADIENT, STATE, CopyEngine
from gockpt.core.errors import ConfigError
from gockpt.testing import first_difference, snapshot

SETTINGS = ("eager", "adversarial")
MODES = ("sync", "async", "async-o", "gockpt", "gockpt-o")
INTERVAL, STEPS = 4, 12


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _use(monkeypatch, device_factory):
    """Make the Checkpointer build its device with ``device_factory`` (CPU tensors)."""
    monkeypatch.setattr(gockpt.checkpointer, "device_for", lambda tensors: device_factory())


def _embedding(seed: int = 0):
    """Forward renormalises most rows of the embedding in place (max_norm)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 8, max_norm=1.0), torch.nn.Flatten(),
                                torch.nn.Linear(24, 2))
    with torch.no_grad():
        model[0].weight.mul_(3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(directory, mode, *, build=_build, set_to_none=True, on_start=None, **options):
    """Train STEPS steps with a checkpoint every INTERVAL steps; returns the handles, the live
    state at each checkpointed step and the Checkpointer (closed). ``on_start(ck)`` runs right
    after each save_checkpoint that returns a handle."""
    model, opt = build()
    if mode in ("gockpt", "gockpt-o"):
        options.setdefault("overlap_steps", 3)
    ck = gockpt.Checkpointer(model, opt, str(directory), mode=mode, block_bytes=256,
                             interval=INTERVAL, **options)
    data = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (STEPS, 4, 3), generator=data)
    handles, live = [], {}
    try:
        for step in range(1, STEPS + 1):
            x = ids[step - 1] if build is _embedding else torch.randn(5, 8, generator=data)
            loss = model(x).pow(2).mean()
            ck.backward_begin()
            loss.backward()
            ck.update_begin()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            handle = ck.save_checkpoint(step)
            if handle is not None:
                handles.append(handle)
                if on_start is not None:
                    on_start(ck)
            if step % INTERVAL == 0:
                live[step] = snapshot(model, opt)
    except BaseException:
        with contextlib.suppress(Exception):  # the loop's error is the one to see
            ck.close()
        raise
    ck.close()
    return handles, live, ck


def _difference(directory, handle, live, build=_build):
    """The first difference between a committed checkpoint and the live state at its step."""
    model, opt = build(seed=5)
    gockpt.load(str(directory), model, opt, tag=os.path.basename(handle.path))
    loaded = snapshot(model, opt)
    return first_difference(live[handle.final_step]["model"], loaded["model"]) or \
        first_difference(live[handle.final_step]["optimizer"], loaded["optimizer"])


# ---------------------------------------------------------------- whole checkpoints on it

@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("mode", MODES)
def test_every_checkpoint_is_the_live_state_on_the_simulated_device(tmp_path, monkeypatch,
                                                                   mode, setting):
    monkeypatch.setenv("GOCKPT_SIMULATED_DEVICE", setting)  # the switch CI uses
    late = []

    def copies_pending(ck):
        late.append(ck.device.pending())

    handles, live, ck = _train(tmp_path, mode, verify=True,
                               on_start=copies_pending if mode == "async-o" else None)
    assert isinstance(ck.device, SimulatedAsyncDevice) and ck.device.setting == setting
    assert ck.device.history and ck.device.pending() == 0  # its copies ran, all of them
    assert [h.final_step for h in handles] == [4, 8, 12]
    for h in handles:
        assert h.done() and h.error is None
        assert _difference(tmp_path, h, live) is None
    if mode == "async-o" and setting == "adversarial":
        # the window's copies were still queued after the boundary that started it
        assert late and all(n > 0 for n in late)


def _resharded(seed: int = 0):
    """Forward moves the first layer's weight to new memory, as FSDP1 does (``p.data = ...``:
    the Parameter object stays, its version too), and the memory it leaves is reused (here:
    filled with NaN) -- what a copy still reading the old address would get."""
    model, opt = _build(seed)

    def move(module, args):
        old = module.weight.data
        module.weight.data = old.clone()
        old.fill_(float("nan"))
    model[0].register_forward_pre_hook(move)
    return model, opt


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("build", [_embedding, _resharded], ids=["written", "moved"])
def test_a_tensor_written_or_moved_during_the_copy_is_found_before_f(tmp_path, monkeypatch,
                                                                      setting, build):
    # An enqueued copy reads its source when it runs: forward's in-place renorm tears it
    # (found by the version watch), or forward moved the weight and its old address holds
    # something else (the version stays: found by the address watch). Either is found at
    # update_begin, so the step is taken again, copied at the boundary -- even with the
    # digests off (before, a wrong checkpoint was committed).
    monkeypatch.setenv("GOCKPT_SIMULATED_DEVICE", setting)
    with pytest.warns(UserWarning, match=r"0\.weight.*copied directly at the step boundary"):
        handles, live, _ = _train(tmp_path, "gockpt-o", build=build, verify=False)
    assert [h.final_step for h in handles if h.error is None] == [4, 8, 12]
    assert all(_difference(tmp_path, h, live, build) is None for h in handles)


# ---------------------------------------------------------------- it catches ordering bugs

class _ForgetsToWait(SimulatedAsyncDevice):
    """Code that reads a host copy without waiting for its event: every ticket of it looks
    complete at once (its events neither run the copies nor wait for them)."""

    def enqueue(self, pairs, high_priority):
        super().enqueue(pairs, high_priority)
        return SimEvent()  # complete: nothing waits for the real one


class _NoStreamWait(SimulatedAsyncDevice):
    """A device whose "compute stream waits for the copies" does not wait."""

    def wait_event(self, event):
        pass


@pytest.mark.parametrize("mode", MODES)
def test_copies_not_waited_for_are_caught_by_the_self_check(tmp_path, monkeypatch, mode):
    _use(monkeypatch, lambda: _ForgetsToWait("adversarial"))
    with pytest.raises(gockpt.CheckpointFailedError, match="differs from the live tensor"):
        with warnings.catch_warnings():  # gockpt first adapts (copies at F): also caught
            warnings.simplefilter("ignore")
            _train(tmp_path, mode, verify=True)
    assert not os.path.exists(os.path.join(tmp_path, "latest"))  # nothing committed


@pytest.mark.parametrize("mode", ["async-o", "gockpt"])
def test_copies_not_waited_for_give_wrong_bytes_without_the_self_check(tmp_path, monkeypatch,
                                                                       mode):
    # The same bug with the digests off: the checkpoint is committed, and it is not the
    # live state -- the simulation, not the self-check, is what makes the bug show.
    _use(monkeypatch, lambda: _ForgetsToWait("adversarial"))
    handles, live, _ = _train(tmp_path, mode, verify=False)
    committed = [h for h in handles if h.error is None]
    assert committed and all(_difference(tmp_path, h, live) is not None for h in committed)


def test_the_same_loop_is_right_on_the_correct_device(tmp_path, monkeypatch):
    # the control of the two tests above: nothing but the device differs
    _use(monkeypatch, lambda: SimulatedAsyncDevice("adversarial"))
    handles, live, _ = _train(tmp_path, "gockpt", verify=False)
    assert handles and all(_difference(tmp_path, h, live) is None for h in handles)


@pytest.mark.parametrize("device", [SimulatedAsyncDevice, _NoStreamWait])
def test_order_after_holds_training_writes_behind_the_copies(device):
    # The gockpt-o step post-hook: order_after(ticket), then the loop writes .grad in place
    # (zero_grad(set_to_none=False)). Run late, a copy whose stream wait did not wait reads
    # the zeros.
    dev = device("adversarial")
    engine = CopyEngine(dev)
    grad = torch.arange(1.0, 65.0)
    host = dev.empty(64, torch.float32)
    ticket = engine.submit([(host, grad)], GRADIENT)
    dev.order_after(ticket)
    grad.zero_()
    ticket.wait()
    if device is SimulatedAsyncDevice:
        assert torch.equal(host, torch.arange(1.0, 65.0))
    else:
        assert torch.equal(host, torch.zeros(64))  # the broken variant is seen
    engine.close()


# ---------------------------------------------------------------- the device itself

def _poisoned(t: torch.Tensor) -> bool:
    return bool((t.view(torch.uint8) == POISON).all())


def test_adversarial_copy_runs_only_when_forced_and_reads_its_source_then():
    dev = SimulatedAsyncDevice("adversarial")
    src, dst = torch.arange(16.0), torch.zeros(16)
    event = dev.enqueue([(dst, src)], high_priority=False)
    assert not event.query() and _poisoned(dst)  # poison until the event
    assert dev.idle() == 1  # nothing runs it unforced
    src += 100  # read when it runs, not when it was enqueued
    event.synchronize()
    assert event.query() and torch.equal(dst, torch.arange(16.0) + 100)
    dev.close()


def test_stream_order_and_events_behind_earlier_copies():
    dev = SimulatedAsyncDevice("adversarial")
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    first = dev.enqueue([(a, torch.ones(4))], high_priority=False)
    second = dev.enqueue([(b, torch.ones(4) * 2)], high_priority=False)
    other = dev.enqueue([(c, torch.ones(4) * 3)], high_priority=True)
    second.synchronize()  # its stream's earlier copies run first, the other stream's not
    assert first.query() and torch.equal(a, torch.ones(4)) and torch.equal(b, torch.ones(4) * 2)
    assert not other.query() and _poisoned(c)
    empty = dev.enqueue([], high_priority=True)  # an event behind what the stream holds
    assert not empty.query()
    empty.synchronize()
    assert other.query() and torch.equal(c, torch.ones(4) * 3)
    dev.close()


def test_eager_runs_unforced_gradients_before_state():
    dev = SimulatedAsyncDevice("eager")
    with dev.hold():  # queue both before the worker chooses
        state = dev.enqueue([(torch.empty(8), torch.ones(8)) for _ in range(3)], False)
        grads = dev.enqueue([(torch.empty(8), torch.ones(8)) for _ in range(2)], True)
        assert dev.idle() == 5  # held: nothing ran
    assert dev.idle() == 0 and state.query() and grads.query()  # ran, unforced
    assert [s for s, _ in dev.history] == ["grad"] * 2 + ["state"] * 3
    dev.close()


def test_sources_stay_alive_until_their_copy_ran():
    dev = SimulatedAsyncDevice("adversarial")
    src, dst = torch.randn(32), torch.empty(32)
    expected, held = src.clone(), weakref.ref(src)
    event = dev.enqueue([(dst, src)], high_priority=True)
    del src  # record_stream: the device holds it
    gc.collect()
    assert held() is not None
    event.synchronize()
    gc.collect()
    assert held() is None and torch.equal(dst, expected)
    dev.close()


def test_tickets_close_and_bad_pairs():
    dev = SimulatedAsyncDevice("adversarial")
    engine = CopyEngine(dev)
    src, dst = torch.randn(10), torch.empty(10)
    ticket = engine.submit([(dst, src)], STATE)
    assert isinstance(ticket.event, SimEvent) and not ticket.done() and ticket.nbytes == 40
    assert engine.bytes_copied == 40 and engine.submit([], STATE).done()
    with pytest.raises(ValueError, match="one dtype and size"):
        engine.submit([(torch.empty(3), torch.empty(4))], STATE)
    engine.close()  # runs what is queued, then stops the worker
    assert ticket.done() and torch.equal(dst, src)
    with pytest.raises(RuntimeError, match="closed"):
        dev.enqueue([(torch.empty(1), torch.empty(1))], high_priority=False)


def test_staging_buffers_start_poisoned():
    buf = SimulatedAsyncDevice("eager").empty(6, torch.float32)
    assert _poisoned(buf) and torch.isnan(buf).all()


def test_the_environment_selects_the_simulated_device(monkeypatch):
    for setting in SETTINGS:
        monkeypatch.setenv("GOCKPT_SIMULATED_DEVICE", setting)
        dev = device_for([torch.zeros(2)])
        assert isinstance(dev, SimulatedAsyncDevice) and dev.setting == setting
    monkeypatch.setenv("GOCKPT_SIMULATED_DEVICE", "lazy")
    with pytest.raises(ConfigError, match="eager, adversarial"):
        device_for([torch.zeros(2)])
    monkeypatch.delenv("GOCKPT_SIMULATED_DEVICE")
    assert isinstance(device_for([torch.zeros(2)]), HostDevice)


def test_the_simulated_and_cuda_devices_share_everything_the_stages_call():
    shared = ("submit", "order_after", "order_after_digests", "device_arena", "copy_now")
    for name in shared:
        assert getattr(SimulatedAsyncDevice, name) is getattr(AsyncDevice, name)
        assert getattr(CudaDevice, name) is getattr(AsyncDevice, name)
    protocol = {n for n, v in vars(Device).items() if inspect.isfunction(v)}
    assert {"submit", "order_after", "mark", "behind", "close"} <= protocol
    for cls in (HostDevice, CudaDevice, SimulatedAsyncDevice):
        assert all(callable(getattr(cls, n, None)) for n in protocol), cls


def test_consecutive_blocks_are_copied_as_one_run():
    from gockpt.capture.gradients import block_runs
    from gockpt.core.blocks import Block, BlockTable
    table = BlockTable([Block(0, 0, 4), Block(0, 4, 8), Block(1, 0, 4), Block(0, 8, 12),
                        Block(1, 8, 12), Block(1, 12, 13)])
    assert block_runs(table) == [(0, 0, 8), (1, 0, 4), (0, 8, 12), (1, 8, 13)]
    assert block_runs(BlockTable([])) == []
