"""The DeepSpeed runs of bench_gpu.py: the same GPT in a DeepSpeed engine (ZeRO 1, bf16, torch's
AdamW as the base optimizer, gradient clipping), DeepSpeed's own ``save_checkpoint`` against
gockpt's patched one.

``ds-none`` trains without checkpoints: the step time the others are measured against.
``ds-native`` saves with DeepSpeed's ``save_checkpoint``; ``ds-async-o`` and ``ds-gockpt-o``
with the same call patched by ``gockpt.integrations.deepspeed.install`` (``async-o``, the
patch's default, and ``gockpt-o``). Blocked time per checkpoint is the time the training
thread spent in what checkpoints: DeepSpeed's ``save_checkpoint`` call for ``ds-native``;
gockpt's hooks (inside the engine's forward, backward and step, and the patched save) as the
library counts them for the patched runs -- the same count as the custom loop's ``in hooks``
column, so the two loops compare like with like. On a GPU, where a wait can be a stream wait
the CPU does not see, it is the wall time the steps of the window took beyond ``ds-none``'s
median step (gockpt's window runs from the save's step to the update after F: its metrics say
F); that wall measure is also the ``wall lost`` column of every run. Committed checkpoints are
deleted between steps, outside the timed part, so that a large model's saves fit on the
machine.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Optional

import torch
from torch.nn import functional as F

import gockpt
from bench_gpu_runs import Setup, Timing, drop_committed, from_metrics, summarise
from model import TinyLlama


def _distributed_env() -> None:
    """A world of one for deepspeed.initialize (on a free port: a benchmark may run beside
    another process that holds DeepSpeed's default)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def build_engine(setup: Setup):
    import deepspeed
    _distributed_env()
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = TinyLlama(setup.cfg)
    # DeepSpeed's bf16 casts the parameters, not these tables: they would promote q and k
    model.rope_cos, model.rope_sin = model.rope_cos.bfloat16(), model.rope_sin.bfloat16()
    config = {"train_micro_batch_size_per_gpu": setup.args.batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1,
                                                        "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def train_engine(setup: Setup, engine, save_dir: Optional[str]) -> Timing:
    """The loop; with ``save_dir``, ``engine.save_checkpoint(save_dir)`` every ``every`` steps
    (inside the step's timed wall time), and the checkpoints committed deleted between steps
    (outside it)."""
    timing = Timing()
    sync = torch.cuda.synchronize if setup.device == "cuda" else (lambda: None)
    t_start, t_between = time.perf_counter(), 0.0
    for step, tokens in enumerate(setup.batches, start=1):
        t0 = time.perf_counter()
        tokens = tokens.to(setup.device)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        saved = save_dir is not None and step % setup.args.every == 0
        ts = time.perf_counter()
        if saved:
            engine.save_checkpoint(save_dir)
        timing.lost.append(time.perf_counter() - ts)
        loss.item()
        sync()
        timing.wall.append(time.perf_counter() - t0)
        if save_dir is not None:  # one checkpoint on disk at a time; not the run's time
            t0 = time.perf_counter()
            drop_committed(save_dir)
            t_between += time.perf_counter() - t0
    timing.total = time.perf_counter() - t_start - t_between
    return timing


def run_none(setup: Setup) -> dict:
    engine = build_engine(setup)
    timing = train_engine(setup, engine, None)
    setup.ds_step_s = statistics.median(timing.wall)
    engine.destroy()
    return summarise(setup, timing, {}, step_s=setup.ds_step_s)


def run_native(setup: Setup) -> dict:
    engine = build_engine(setup)
    save_dir = os.path.join(setup.work, "ds-native")
    timing = train_engine(setup, engine, save_dir)
    every = setup.args.every
    timing.windows = [range(s - 1, s) for s in range(every, len(timing.wall) + 1, every)]
    engine.destroy()
    return summarise(setup, timing, {}, step_s=setup.ds_step_s)


def gockpt_run(mode: str):
    def run(setup: Setup) -> dict:
        from gockpt.integrations import deepspeed as gockpt_ds
        options = {"emulate_link_gbps": setup.link_gbps} if setup.device == "cpu" else {}
        if setup.args.ds_grad_transport != "auto":
            options["grad_transport"] = setup.args.ds_grad_transport
        save_dir = os.path.join(setup.work, f"ds-{mode}")
        # interval and directory: the saves to come are known (as the torch runs' Checkpointer
        # knows them), so that the patch's Checkpointer is made with the engine and the replay
        # modes start copying K steps ahead of every save, the first included
        gockpt_ds.install(mode=mode, interval=setup.args.every, directory=save_dir,
                          on_busy="wait", **options)
        try:
            engine = build_engine(setup)
            timing = train_engine(setup, engine, save_dir)
            patch = gockpt_ds._patches[engine]
            host = patch.ck.host_bytes if patch.ck is not None else 0
            gockpt_ds.wait(engine)
        finally:
            gockpt_ds.uninstall()
        # steps are 1-based, timing.wall 0-based: the save's step .. the update after F
        timing.windows = [range(r["start_step"] - 1, r["final_step"] + 1)
                          for r in gockpt.metrics.read(save_dir)]
        engine.destroy()
        result = summarise(setup, timing, from_metrics(save_dir, host), step_s=setup.ds_step_s)
        if setup.device != "cuda":  # gockpt's hooks, as the library counts them
            hooks = result.get("gockpt_blocked_all_s") or []
            result.update(blocked_median_s=result.get("gockpt_blocked_median_s"),
                          blocked_first_s=hooks[0] if hooks else None, blocked_all_s=hooks)
        return result
    return run


RUNS = {"ds-none": run_none, "ds-native": run_native,
        "ds-async-o": gockpt_run("async-o"), "ds-gockpt-o": gockpt_run("gockpt-o")}
