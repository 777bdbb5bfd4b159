"""Each framework's own checkpoint beside gockpt's in that framework, side by side in one run.

    python experiments/bench_integrations.py [--steps 60] [--every 10] [--rounds 2]
                                             [--only lightning,transformers,dcp]

One model (eight 512x512 Linear layers with biases: 2.1 M parameters, 25 MB of fp32 weights and
AdamW moments) trained on the CPU with a checkpoint every ``--every`` steps, in each framework:

- PyTorch Lightning: no checkpoint; ``ModelCheckpoint(every_n_train_steps=N)`` (Lightning's
  own save, ``torch.save`` in the loop); ``GockptCallback`` (gockpt-o).
- Hugging Face Trainer: ``save_strategy="no"``; ``Trainer(save_steps=N)`` (its own
  ``checkpoint-N`` folders); ``GockptTrainer`` (gockpt-o).
- A loop that saves with ``torch.distributed.checkpoint`` (torchtitan's way): no checkpoint;
  ``dcp.async_save`` through DCP's ``FileSystemWriter``; the same through gockpt's
  ``GockptWriter``; gockpt's own hooks (``Checkpointer``, gockpt-o) in that loop.

gockpt's copies go through an emulated device-to-host link (``Config.emulate_link_gbps``) at
a rate at which one full copy of the state takes 3 of that framework's measured steps, as a GPU's
PCIe link would stand to its step; K = 3. The framework's own saves copy at memory speed
(no link: they would be slower on a GPU, not faster).

Blocked per checkpoint: the training thread's time inside the save calls (the framework's
save method, timed around it), or gockpt's own account (``metrics.blocked_s``: its hooks' time
inside windows). Mean step: the mean time between training steps from step 5 on, against the
run without checkpoints (median over ``--rounds``, the runs of a framework alternating).
Checkpoints go to a fresh directory under ``/dev/shm`` (the writes' cost, not a disk's).
DeepSpeed's own save beside the patched engine: ``experiments/bench_gpu.py --emulate-link auto
--runs ds-native,ds-gockpt-o``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import gockpt  # noqa: E402

DIM, LAYERS, BATCH = 512, 8, 64
STATE_BYTES = 12 * LAYERS * (DIM * DIM + DIM)


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])


class Timed:
    """Wraps ``owner.name`` to time each call (the training thread's time inside it)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.seconds = owner, name, []
        self.original = getattr(owner, name)

    def __enter__(self):
        original, seconds = self.original, self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - t0)
        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)


def gockpt_blocked(directory: str) -> list:
    return [m["blocked_s"] for m in gockpt.metrics.read(directory)]


def mean_step(times: list) -> float:
    gaps = [b - a for a, b in zip(times[5:], times[6:])]
    return statistics.mean(gaps)


# -- PyTorch Lightning -------------------------------------------------------------------------

def lightning_run(kind: str, args, link_gbps: float, where: str):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset
    from gockpt.integrations.lightning import GockptCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.times = network(), []

        def training_step(self, batch, i):
            self.times.append(time.perf_counter())
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    callbacks, timed = [], None
    if kind == "own":
        callbacks = [pl.callbacks.ModelCheckpoint(dirpath=where, every_n_train_steps=args.every,
                                                  save_top_k=-1)]
    elif kind == "gockpt":
        callbacks = [GockptCallback(where, every_n_train_steps=args.every, overlap_steps=3,
                                    emulate_link_gbps=link_gbps)]
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=False,
                         enable_checkpointing=kind == "own", enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    module = Module()
    data = DataLoader(TensorDataset(torch.randn(BATCH * 8, DIM)), batch_size=BATCH)
    with Timed(pl.Trainer, "save_checkpoint") as timed:
        trainer.fit(module, data)
    blocked = gockpt_blocked(where) if kind == "gockpt" else timed.seconds
    return mean_step(module.times), blocked


# -- Hugging Face Trainer ----------------------------------------------------------------------

class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = network()

    def forward(self, x):
        return {"loss": self.net(x).square().mean()}


def transformers_run(kind: str, args, link_gbps: float, where: str):
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from gockpt.integrations.transformers import GockptTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *a, **kw):
            self.times.append(time.perf_counter())

    clock = Clock()
    targs = TrainingArguments(where, per_device_train_batch_size=BATCH, max_steps=args.steps,
                              save_strategy="no" if kind == "none" else "steps",
                              save_steps=args.every, report_to=[], disable_tqdm=True,
                              use_cpu=True, logging_strategy="no", optim="adamw_torch")
    data = [{"x": x} for x in torch.randn(BATCH * 8, DIM)]
    cls, extra = (GockptTrainer, {"gockpt_options": {"overlap_steps": 3,
                                                     "emulate_link_gbps": link_gbps}}) \
        if kind == "gockpt" else (Trainer, {})
    trainer = cls(model=_Regression(), args=targs, train_dataset=data, callbacks=[clock],
                  **extra)
    with Timed(Trainer, "_save_checkpoint") as timed:
        trainer.train()
    blocked = gockpt_blocked(where) if kind == "gockpt" else timed.seconds
    return mean_step(clock.times), blocked


# -- a loop that saves with torch.distributed.checkpoint ---------------------------------------

def dcp_run(kind: str, args, link_gbps: float, where: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from gockpt.storage.dcp import GockptWriter

    model = network()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(BATCH * 8, DIM)
    ck = gockpt.Checkpointer(model, opt, where, interval=args.every, overlap_steps=3,
                             emulate_link_gbps=link_gbps) if kind == "gockpt" else None
    times, blocked, pending = [], [], None
    for step in range(1, args.steps + 1):
        times.append(time.perf_counter())
        if ck:
            ck.backward_begin()
        model(data[(step % 8) * BATCH:(step % 8 + 1) * BATCH]).square().mean().backward()
        if ck:
            ck.update_begin()
        opt.step()
        opt.zero_grad()
        if ck:
            ck.save_checkpoint(step)
        elif kind != "none" and step % args.every == 0:
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()  # (as torchtitan: one save in flight)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optimizer": osd, "train_state": {"step": step}}
            writer = GockptWriter(where, step=step) if kind == "gockpt-writer" else \
                dcp.FileSystemWriter(os.path.join(where, f"step-{step}"))
            pending = dcp.async_save(state, storage_writer=writer)
            blocked.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    if ck:
        ck.close()
        blocked = gockpt_blocked(where)
    return mean_step(times), blocked


FRAMEWORKS = {
    "lightning": (lightning_run, [("none", "none"), ("own", "ModelCheckpoint"),
                                  ("gockpt", "GockptCallback (gockpt-o)")]),
    "transformers": (transformers_run, [("none", "none"), ("own", "Trainer save_steps"),
                                        ("gockpt", "GockptTrainer (gockpt-o)")]),
    "dcp": (dcp_run, [("none", "none"), ("own", "dcp.async_save FileSystemWriter"),
                      ("gockpt-writer", "dcp.async_save GockptWriter"),
                      ("gockpt", "Checkpointer (gockpt-o)")]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(FRAMEWORKS))
    args = ap.parse_args()
    print(f"state {STATE_BYTES / 1e6:.1f} MB, {args.steps} steps, a checkpoint every "
          f"{args.every}, {torch.get_num_threads()} torch threads, {args.rounds} rounds\n")
    print("| framework | save | mean step ms | vs none | blocked/ckpt ms | checkpoints |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.only.split(","):
        run, kinds = FRAMEWORKS[name]
        steps, blocked = {}, {}
        link = None
        for _ in range(args.rounds):
            for kind, _label in kinds:
                where = tempfile.mkdtemp(prefix="gockpt-bench-", dir="/dev/shm")
                try:
                    step, b = run(kind, args, link or 1.0, where)
                finally:
                    shutil.rmtree(where, ignore_errors=True)
                if kind == "none" and link is None:  # one full copy: 3 of these steps
                    link = STATE_BYTES / (3 * step) / 1e9
                steps.setdefault(kind, []).append(step)
                blocked.setdefault(kind, []).extend(b)
        base = statistics.median(steps["none"])
        for kind, label in kinds:
            s = statistics.median(steps[kind])
            b = f"{statistics.mean(blocked[kind]) * 1e3:.1f}" if blocked[kind] else "-"
            print(f"| {name} | {label} | {s * 1e3:.2f} | {s / base:.3f}x | {b} | "
                  f"{len(blocked[kind]) // args.rounds} |", flush=True)
    print("\n(link emulated for gockpt: one full copy in 3 steps of the run without "
          "checkpoints)")


if __name__ == "__main__":
    main()
