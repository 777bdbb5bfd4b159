"""The runs of bench_gpu.py: one training loop, timed the same way for every scheme.

Blocked time per checkpoint is measured by the loop itself: the time spent inside the hooks
plus what ``optimizer.step()`` took beyond its own cost (its hooks, a wait for copies), summed
over the steps of the checkpoint's window (the boundary that starts it to the update after F).
On a GPU, where a wait can be a stream wait that the CPU does not see, the loss of wall time per
step against the ``none`` run is used instead (every step ends with ``loss.item()``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

import gockpt
from gockpt.replay import adapters
from gockpt.replay.adapters import AdamAdapter
from model import TinyLlama, batch, num_params


@dataclass
class Timing:
    """Per step: seconds inside the scheme's hooks and waits; step wall times; starts."""

    lost: List[float] = field(default_factory=list)
    wall: List[float] = field(default_factory=list)
    update: List[float] = field(default_factory=list)
    windows: List[range] = field(default_factory=list)
    total: float = 0.0


class Setup:
    """The model, data and baseline measurements shared by every run of one benchmark."""

    def __init__(self, cfg, args, device: str, work: str):
        self.cfg, self.args, self.device, self.work = cfg, args, device, work
        self.batches = [batch(s, args.batch, cfg) for s in range(args.steps)]
        self.update_s = 0.0      # median optimizer.step() time without checkpoints
        self.fwd_bwd_s = 0.0
        self.step_s = 0.0
        self.ds_step_s = 0.0     # the same for the DeepSpeed engine (bench_gpu_deepspeed)
        self.link_gbps: Optional[float] = None
        self.state_bytes = 0
        self.trace: Optional[str] = None  # a run's profiler output, path prefix (see profiler)

    def build(self):
        torch.manual_seed(0)
        with torch.device(self.device):  # initialised where it trains: no host copy of it
            model = TinyLlama(self.cfg)
        fused = {"fused": True} if self.device == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **fused)
        return model, opt

    def calibrate(self) -> None:
        """State size, and the link rate of --emulate-link GBPS."""
        with torch.device("meta"):  # counted without taking memory
            self.state_bytes = 12 * num_params(TinyLlama(self.cfg))
        rate = self.args.emulate_link
        if rate is not None and rate != "auto":
            self.link_gbps = float(rate)

    def describe(self) -> dict:
        return {"device": self.device if self.device == "cuda" else "cpu (emulated link)",
                "gpu": torch.cuda.get_device_name() if self.device == "cuda" else None,
                "size": self.args.size, "model": vars(self.cfg), "batch": self.args.batch,
                "params": self.state_bytes // 12, "state_bytes": self.state_bytes,
                "checkpoints_in": self.work, "steps": self.args.steps,
                "every": self.args.every, "k": self.args.k,
                "link_gbps": self.link_gbps, "step_s": self.step_s,
                "fwd_bwd_s": self.fwd_bwd_s, "update_s": self.update_s,
                "ds_step_s": self.ds_step_s,
                "torch": torch.__version__, "torch_threads": torch.get_num_threads()}

    def headline(self) -> str:
        link = f", link {self.link_gbps:.3f} GB/s (a full copy: " \
               f"{self.state_bytes / (self.link_gbps * 1e9) / self.fwd_bwd_s:.1f} fwd/bwd)" \
            if self.link_gbps else ""
        return (f"{self.state_bytes // 12 / 1e6:.1f}M params, {self.state_bytes / 1e6:.0f} MB of "
                f"state, step {self.step_s * 1e3:.0f} ms (fwd/bwd {self.fwd_bwd_s * 1e3:.0f} ms)"
                f"{link}; a checkpoint every {self.args.every} steps, {self.args.steps} steps")


def train(setup: Setup, model, opt, hooks=None, on_step: Callable = None) -> Timing:
    """The loop: ``hooks`` has backward_begin/update_begin/boundary/before_step callables."""
    timing = Timing()
    sync = torch.cuda.synchronize if setup.device == "cuda" else (lambda: None)
    prof = profiler(setup)
    t_start, t_between = time.perf_counter(), 0.0
    for step, tokens in enumerate(setup.batches):
        t0 = time.perf_counter()
        lost = 0.0
        with torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.device == "cuda"):
            loss = model.loss(tokens.to(setup.device))
        if hooks:
            lost += _timed(hooks.backward_begin, prof)
        loss.backward()
        if hooks:
            lost += _timed(hooks.update_begin, prof)
        t_fwd_bwd = time.perf_counter() - t0
        tu = time.perf_counter()
        opt.step()
        timing.update.append(time.perf_counter() - tu)
        opt.zero_grad()
        if hooks:
            lost += _timed(lambda: hooks.boundary(step + 1), prof, "boundary")
        loss.item()
        sync()
        timing.lost.append(lost)
        timing.wall.append(time.perf_counter() - t0)
        if on_step:  # (the benchmark's own work between steps: not the run's time)
            t0 = time.perf_counter()
            on_step(step, t_fwd_bwd)
            t_between += time.perf_counter() - t0
        if prof is not None:
            prof.step()
    timing.total = time.perf_counter() - t_start - t_between
    if prof is not None:
        prof.stop()
    return timing


def profiler(setup: Setup):
    """With ``setup.trace`` set: a started torch.profiler over the steps around one
    checkpoint's F (the second checkpoint where the run has one, past the first's warm-up),
    written at the end to ``<trace>.txt`` (the ops by device and by CPU time) and
    ``<trace>.json.gz`` (a Chrome trace). Where the time of a window goes, when a target is
    missed; the traced run's own timings are not the benchmark's."""
    if not setup.trace:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule
    every, steps = setup.args.every, setup.args.steps
    f = 2 * every if steps >= 2 * every + 4 else every
    first = max(0, f - 8)  # K <= 4 copy steps before F, and the boundaries around them
    activities = [ProfilerActivity.CPU] + \
        ([ProfilerActivity.CUDA] if setup.device == "cuda" else [])

    def write(prof) -> None:
        events = prof.key_averages()
        with open(setup.trace + ".txt", "w") as out:
            out.write(f"steps {first}..{first + 11} (checkpoint at {f}, every {every})\n\n")
            for key in (("self_cuda_time_total",) if setup.device == "cuda" else ()) + \
                    ("self_cpu_time_total",):
                out.write(f"by {key}:\n{events.table(sort_by=key, row_limit=40)}\n\n")
        prof.export_chrome_trace(setup.trace + ".json")
        import gzip
        with open(setup.trace + ".json", "rb") as src, gzip.open(setup.trace + ".json.gz",
                                                                "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(setup.trace + ".json")

    prof = profile(activities=activities, on_trace_ready=write,
                   schedule=schedule(wait=max(0, first - 1), warmup=1 if first else 0,
                                     active=12, repeat=1))
    prof.start()
    return prof


def _timed(fn, prof=None, name: str = "") -> float:
    t0 = time.perf_counter()
    if prof is None:
        fn()
    else:  # a named range in the trace
        with torch.profiler.record_function(f"hook:{name or fn.__name__}"):
            fn()
    return time.perf_counter() - t0


def summarise(setup: Setup, timing: Timing, extra: dict, step_s: Optional[float] = None) -> dict:
    """The JSON record of one run. ``step_s``: the baseline step time of another loop than
    ``none``'s (DeepSpeed's: its steps' ``timing.lost`` is the time inside the calls that
    block, without an update of its own)."""
    # On a GPU a stream wait that the CPU does not see shows up as a longer step
    by_wall = setup.device == "cuda"
    step_s = setup.step_s if step_s is None else step_s
    lost, wall = [], []
    for window in timing.windows:
        steps = [s for s in window if s < len(timing.wall)]
        wall.append(sum(max(0.0, timing.wall[s] - step_s) for s in steps))
        lost.append(wall[-1] if by_wall else
                    sum(timing.lost[s] + (max(0.0, timing.update[s] - setup.update_s)
                                          if timing.update else 0.0) for s in steps))
    base = step_s * len(timing.wall)
    inside = {s for window in timing.windows for s in window}
    return {"blocked_median_s": statistics.median(lost) if lost else None,
            # what the steps outside every window took beyond the loop's median step (a run's
            # start: its host memory, the first steps' warm-up)
            "wall_lost_outside_windows_s": sum(max(0.0, w - step_s) for s, w in
                                               enumerate(timing.wall) if s not in inside),
            "wall_steps_s": [round(w, 5) for w in timing.wall],
            "blocked_first_s": lost[0] if lost else None,
            "blocked_all_s": lost,
            # every loop alike: what the window's steps took beyond the loop's median step
            # (on the CPU this also counts gockpt's threads contending for the cores)
            "wall_lost_median_s": statistics.median(wall) if wall else None,
            "overhead_vs_none": (timing.total - base) / base if base else 0.0,
            **extra}


# ------------------------------------------------------------------ the runs

def run_none(setup: Setup) -> dict:
    model, opt = setup.build()
    fwd_bwd = []
    timing = train(setup, model, opt, on_step=lambda s, t: fwd_bwd.append(t))
    setup.step_s = statistics.median(timing.wall)
    setup.update_s = statistics.median(timing.update)
    setup.fwd_bwd_s = statistics.median(fwd_bwd)
    if setup.args.emulate_link == "auto":
        setup.link_gbps = setup.state_bytes / (setup.args.copy_steps * setup.fwd_bwd_s) / 1e9
    return summarise(setup, timing, _empty())


def _empty() -> dict:
    return {"blocked_by_hook_s": {}, "time_to_staged_median_s": None,
            "time_to_durable_median_s": None, "copy_gbps": None, "host_bytes": 0}


class _GockptHooks:
    def __init__(self, ck, timing_windows: list):
        self.ck, self.windows = ck, timing_windows
        self.backward_begin, self.update_begin = ck.backward_begin, ck.update_begin

    def boundary(self, step: int) -> None:
        h = self.ck.save_checkpoint(step)
        if h is not None:  # steps step-1 (this boundary) .. F (the update after F)
            self.windows.append(range(step - 1, h.final_step + 1))


def gockpt_run(mode: str, k: Optional[int], verify: bool = True,
               tag: str = "") -> Callable[[Setup], dict]:
    def run(setup: Setup) -> dict:
        model, opt = setup.build()
        directory = os.path.join(setup.work, f"{mode}-{k}-{verify}{tag}")
        options = {"emulate_link_gbps": setup.link_gbps} if setup.device == "cpu" else {}
        ck = gockpt.Checkpointer(model, opt, directory, mode=mode, overlap_steps=k,
                                 interval=setup.args.every, on_busy="wait", verify=verify,
                                 **options)
        windows: list = []
        timing = train(setup, model, opt, _GockptHooks(ck, windows),
                       on_step=lambda step, _: drop_committed(directory))
        timing.windows = windows
        host = ck.host_bytes
        ck.close()
        return summarise(setup, timing, from_metrics(directory, host))
    return run


def drop_committed(directory: str) -> None:
    """Delete the committed checkpoints in ``directory`` (its subdirectories but the ``.tmp-*``
    one being written): a large model's state fits on the machine once, not twice, and the
    benchmark needs none of them."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        path = os.path.join(directory, name)
        if not name.startswith(".") and os.path.isdir(path):
            shutil.rmtree(path)


def from_metrics(directory: str, host: int) -> dict:
    records = gockpt.metrics.read(directory)
    if not records:
        return _empty()
    hooks = sorted({h for r in records for h in r["blocked_by_hook_s"]})
    copied = [(r["state_bytes"] + r["grad_bytes"]) / r["copy_s"] for r in records
              if r["copy_s"] > 0]
    return {"blocked_by_hook_s": {h: statistics.median(r["blocked_by_hook_s"].get(h, 0.0)
                                                       for r in records) for h in hooks},
            # what gockpt's hooks took on the training thread, as the library counts it
            # (``metrics.jsonl``'s ``blocked_s``), per checkpoint in order
            "gockpt_blocked_median_s": statistics.median(r["blocked_s"] for r in records),
            "gockpt_blocked_all_s": [r["blocked_s"] for r in records],
            "k": [r["overlap_steps"] for r in records],
            "time_to_staged_median_s": statistics.median(r["time_to_staged_s"] for r in records),
            "time_to_durable_median_s": statistics.median(r["time_to_durable_s"]
                                                          for r in records),
            "copy_gbps": statistics.median(copied) / 1e9 if copied else None,
            # the verification against the live state: its background time per checkpoint
            "verify_median_s": statistics.median(r.get("verify_s", 0.0) for r in records),
            "host_bytes": host}


def run_reference(setup: Setup) -> dict:
    """A copy-only schedule: every state tensor copied into buffers allocated beforehand
    under the next forward/backward; the next optimizer step waits for it. No persistence."""
    model, opt = setup.build()
    copier = reference_copier(setup, model, opt)
    windows: list = []

    class Hooks:
        backward_begin = staticmethod(lambda: None)
        update_begin = staticmethod(copier.wait)

        @staticmethod
        def boundary(step):
            if step % setup.args.every == 0:
                copier.start()
                windows.append(range(step - 1, step + 1))

    timing = train(setup, model, opt, Hooks())
    copier.wait()  # a copy the last boundary started still writes into the host buffers
    timing.windows = windows
    return summarise(setup, timing, dict(_empty(), host_bytes=copier.nbytes,
                                         copy_gbps=copier.gbps()))


def reference_copier(setup: Setup, model, opt):
    return (_CudaCopier if setup.device == "cuda" else _EmulatedCopier)(setup, model, opt)


class _Copier:
    def __init__(self, setup, model, opt):
        self.model, self.opt = model, opt
        self.pending, self.seconds, self.bytes = None, [], 0
        self.host: Dict[int, torch.Tensor] = {}

    def tensors(self):
        out = [p.detach() for p in self.model.parameters()]
        for st in self.opt.state.values():
            out += [v for k, v in st.items() if k != "step"]
        return out

    def buffers(self, pin: bool):
        """(host buffer, live tensor) of every state tensor; buffers allocated once."""
        pairs = []
        for t in self.tensors():
            key = (t.data_ptr(), t.numel())
            if key not in self.host:
                self.host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            pairs.append((self.host[key], t))
        return pairs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def gbps(self) -> Optional[float]:
        return self.bytes / sum(self.seconds) / 1e9 if self.seconds else None


class _EmulatedCopier(_Copier):
    def __init__(self, setup, model, opt):
        super().__init__(setup, model, opt)
        from gockpt import _C
        self.engine = _C.CopyEngine(setup.link_gbps * 1e9)

    def start(self):
        pairs = self.buffers(False)
        dst = np.array([d.data_ptr() for d, _ in pairs], dtype=np.int64)
        src = np.array([s.data_ptr() for _, s in pairs], dtype=np.int64)
        size = np.array([s.numel() * s.element_size() for _, s in pairs], dtype=np.int64)
        self.pending = self.engine.submit(1, dst, src, size)
        self.bytes += int(size.sum())

    def wait(self):
        if self.pending is not None:
            self.engine.wait(self.pending)
            self.seconds.append(self.engine.seconds(self.pending))
            self.engine.release(self.pending)
            self.pending = None


class _CudaCopier(_Copier):
    def __init__(self, setup, model, opt):
        super().__init__(setup, model, opt)
        self.stream = torch.cuda.Stream()

    def start(self):
        pairs = self.buffers(True)
        ready, self.begin, done = (torch.cuda.Event(enable_timing=t) for t in (False, True, True))
        ready.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.begin.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        self.pending = done
        self.bytes += sum(s.numel() * s.element_size() for _, s in pairs)

    def wait(self):
        if self.pending is not None:  # on the GPU: the optimizer step waits, the CPU goes on
            torch.cuda.current_stream().wait_event(self.pending)
            self.pending.synchronize()
            self.seconds.append(self.begin.elapsed_time(self.pending) / 1e3)
            self.pending = None


def plain(tree, path: str = "state"):
    """``tree`` with its mappings as dicts: torch 2.11's DefaultStager failed on the H200 with
    ``KeyError: <class 'type'>`` reconstructing an object of the state dicts (2.13's does not);
    a leaf that is not a tensor, number, string or None is said on stderr."""
    if isinstance(tree, dict):
        return {k: plain(v, f"{path}[{k!r}]") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(plain(v, f"{path}[{i}]") for i, v in enumerate(tree))
    if not isinstance(tree, (torch.Tensor, int, float, str, type(None))):
        print(f"dcp-async: {path} is a {type(tree).__name__}", file=sys.stderr)
    return tree


def run_dcp_async(setup: Setup) -> dict:
    """torch.distributed.checkpoint.async_save with DefaultStager as PyTorch's "zero-overhead"
    checkpointing sets it up (CUDA): pinned host buffers, the device-to-host copy on a
    background thread and its own stream, the next optimizer step waiting for it. (Shared
    memory is for a process-based upload; this one is thread-based, and a large model's
    staging would fill /dev/shm.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    model, opt = setup.build()
    cuda = setup.device == "cuda"  # (the stager refuses these without one)
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=cuda, use_non_blocking_copy=cuda))
    windows, state = [], {"pending": None}

    def start(step):
        if step % setup.args.every:
            return
        if state["pending"] is not None:
            _result(state["pending"]).result()
        state["dir"] = os.path.join(setup.work, f"dcp-{step}")
        sd = plain({"model": model.state_dict(), "optim": opt.state_dict()})
        state["pending"] = dcp.async_save(sd, checkpoint_id=state["dir"], async_stager=stager,
                                          no_dist=True)
        windows.append(range(step - 1, step + 1))

    def before_update():
        pending = state["pending"]
        staging = getattr(pending, "staging_completion", None)
        if staging is not None:
            staging.result()  # the state must not change while it is staged

    def drop_older(step, _):  # the finished ones (as for gockpt's runs)
        for name in os.listdir(setup.work):
            path = os.path.join(setup.work, name)
            if name.startswith("dcp-") and (path != state.get("dir") or
                                            _result(state["pending"]).done()):
                shutil.rmtree(path)

    class Hooks:
        backward_begin = staticmethod(lambda: None)
        update_begin = staticmethod(before_update)
        boundary = staticmethod(start)

    timing = train(setup, model, opt, Hooks(), on_step=drop_older)
    if state["pending"] is not None:
        _result(state["pending"]).result()
    stager.close()
    timing.windows = windows
    return summarise(setup, timing, _empty())


def _result(pending):
    return getattr(pending, "upload_completion", pending)


RUNS = {
    "none": run_none,
    "reference": run_reference,
    "sync": gockpt_run("sync", None),
    "async": gockpt_run("async", None),
    "async-o": gockpt_run("async-o", None),
    "gockpt": gockpt_run("gockpt", None),
    "gockpt-o": gockpt_run("gockpt-o", None),
    "gockpt-o-k": None,  # filled below with --k
    "dcp-async": run_dcp_async,
    # the same without the verification against the live state (Config.verify=False): its cost
    "async-noverify": gockpt_run("async", None, verify=False),
    "gockpt-o-k-noverify": None,
    "gockpt-o-k-partial": None,  # the parameters copied at F, the moments replayed
}


def _fixed_k(setup: Setup) -> dict:
    return gockpt_run("gockpt-o", setup.args.k)(setup)


def _fixed_k_unverified(setup: Setup) -> dict:
    return gockpt_run("gockpt-o", setup.args.k, verify=False)(setup)


class _MomentsOnly(AdamAdapter):
    """torch's AdamW with every parameter line marked as not reproduced: what DeepSpeed's CUDA
    FusedAdam gets (its moments replayed, its parameters copied at F)."""

    def params_not_replayed(self):
        return {id(p): "benchmark: the parameter line is not claimed"
                for g in self.optimizer.param_groups for p in g["params"]}


def _fixed_k_partial(setup: Setup) -> dict:
    """gockpt-o with K fixed, the moments replayed and the parameters copied at F."""
    original = adapters.adapter_for
    adapters.adapter_for = _MomentsOnly
    try:
        return gockpt_run("gockpt-o", setup.args.k, tag="-partial")(setup)
    finally:
        adapters.adapter_for = original


RUNS["gockpt-o-k"] = _fixed_k
RUNS["gockpt-o-k-noverify"] = _fixed_k_unverified
RUNS["gockpt-o-k-partial"] = _fixed_k_partial
