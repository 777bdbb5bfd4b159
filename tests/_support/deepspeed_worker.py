"""One rank of the DeepSpeed tests (tests/_support/deepspeed_cases.py, started by
tests/_support/dist_ranks.py): trains a tiny model with a DeepSpeed engine on its accelerator
(the CPU here, CUDA on a GPU machine) and writes what the test compares.  Scenario keys beyond
the run: "stage", "steps", "save_at" (a step or a list of steps), "gas", "clip", "options",
"gockpt_section", "fp32_accumulation", "two_groups", "torch_adam" (torch's AdamW as base
optimizer), "early" (the save run's directory and interval given to install()), "betas" (AdamW's), "fp16" (with dynamic loss scaling), "inf_at" (a step whose loss
is multiplied by inf: an overflow step under fp16), "width" (of the hidden layer, 48 by
default), "chunk_bytes" (of the checkpoint's checksum chunks), "leave_at_once" (the process
ends right after writing its results, closing nothing: the memory tier's copy stays, as a
crash leaves it; with the step log, its last step's entry written first), "log" (client_state
given as a callable, as the step log asks), "lives" (the live state of every step dumped).

    python -m tests._support.deepspeed_worker OUT SCENARIO
                                            SCENARIO: JSON {"run": ..., "stage": ..., ...}

runs: "plain" (no gockpt), "patched" (gockpt, no checkpoint), "save" (gockpt, a checkpoint
at each step of "save_at", client_state given as a dict of values as DeepSpeed users do; the
live state at the last one is dumped), "resume" (a fresh engine loads the checkpoint in
"load_dir" and trains on, saving again at the steps of "resave_at" into "resave_dir"),
"refused" (a fresh engine's load_checkpoint of "load_dir" must fail: the error and whether the
engine's state stayed as it was are dumped), "native-save" / "native-load" (DeepSpeed's own checkpoints, loaded through the patched
engine), "plain-load" (DeepSpeed alone -- gockpt not installed, and not even importable until
the load is done -- loads the DeepSpeed checkpoint in "load_dir", e.g. one written by
`gockpt export --to deepspeed`, and trains on).  Each rank writes OUT/<run>-rank<r>.pt: losses
and states.  "kill" (gockpt): a checkpoint at the first step of "save_at" commits; in the
second's write rank 1 kills itself (SIGKILL), and every other rank waits for a commit that
cannot come (the test stops it, as torchrun would).
"""

import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))


def model_of(sc) -> torch.nn.Module:
    torch.manual_seed(0)
    width = sc.get("width", 48)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(),
                               torch.nn.Linear(width, 40), torch.nn.GELU(), torch.nn.Linear(40, 4))


def config_of(sc) -> dict:
    """The DeepSpeed config of scenario ``sc``."""
    cfg = {"train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": sc.get("gas", 1),
           "gradient_clipping": sc.get("clip", 0.05),
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1,
                                                     "betas": sc.get("betas", [0.9, 0.999]),
                                                     "torch_adam": sc.get("torch_adam", False)}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5,
                                                         "warmup_max_lr": 3e-3}},
           "zero_optimization": {"stage": sc["stage"]},
           # fp16: dynamic loss scaling from 2^8, so that an injected inf is an overflow step
           **({"fp16": {"enabled": True, "initial_scale_power": 8}} if sc.get("fp16")
              else {"bf16": {"enabled": True}}),
           "steps_per_print": 10 ** 9}
    if sc.get("gockpt_section"):
        cfg["gockpt"] = sc["gockpt_section"]
    if sc.get("fp32_accumulation"):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def build(sc):
    import deepspeed
    model, cfg = model_of(sc), config_of(sc)
    params = model.parameters()
    if sc.get("two_groups"):  # the usual decay / no-decay split: DeepSpeed steps group by group
        params = [{"params": [p for p in model.parameters() if p.dim() > 1]},
                  {"params": [p for p in model.parameters() if p.dim() == 1],
                   "weight_decay": 0.0}]
    if sc.get("fp16"):
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (this
        # depends on the CPU: AMD EPYC has none, recent Xeons do), a matter of speed only --
        # torch computes in fp16 on any CPU. The case is about the dynamic loss scaler's state,
        # so it runs everywhere rather than only on some CI machines.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def batch(step, micro, rank, engine, sc):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(4, 16, generator=g)
    x = x.half() if sc.get("fp16") else x.bfloat16()
    return x.to(engine.device), torch.randn(4, 4, generator=g).to(engine.device)


def train(engine, sc, first, last, out, at=None):
    """Engine steps first..last (1-based); ``at(step)`` after each."""
    rank = torch.distributed.get_rank()
    for step in range(first, last + 1):
        for micro in range(sc.get("gas", 1)):
            x, y = batch(step, micro, rank, engine, sc)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y)
            out["losses"].append(loss.item())
            if step == sc.get("inf_at"):  # an overflow: DeepSpeed skips this step (fp16)
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        if at is not None:
            at(step)


def live_state(engine):
    from gockpt.integrations.deepspeed.state import EngineState, base_optimizer, fp32_layout
    base = base_optimizer(engine)
    opt = {f"{i}/{k}": (v.clone() if torch.is_tensor(v) else torch.tensor(float(v)))
           for i, st in enumerate(base.state.values()) for k, v in st.items()}
    return {"tensors": {k: v.clone() for k, v in EngineState(engine).state_dict().items()},
            "optimizer": opt, "counters": [engine.global_steps, engine.global_samples,
                                           engine.skipped_steps],
            # where this rank's fp32 partition holds each parameter, and the scheduler: what
            # a load at another data-parallel degree is compared by
            "layout": fp32_layout(engine), "scheduler": engine.lr_scheduler.state_dict()}


def states_equal(a, b) -> bool:
    """Whether two live_state snapshots hold the same bits."""
    same = all(x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8),
                                                  y.view(-1).view(torch.uint8))
               for part in ("tensors", "optimizer") for x, y in zip(a[part].values(),
                                                                    b[part].values()))
    return same and all(a[k] == b[k] for k in ("counters", "scheduler")) and \
        all(a[p].keys() == b[p].keys() for p in ("tensors", "optimizer"))


class NoGockpt:
    """An import hook that refuses gockpt: the plain-load run builds and loads without it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "gockpt":
            raise ImportError(f"{name}: imported while DeepSpeed alone builds and loads")
        return None


def main():
    out_dir, sc = sys.argv[1], json.loads(sys.argv[2])
    if sc["run"] == "plain-load":  # as if gockpt were not installed (the fork server has it)
        for name in [m for m in sys.modules if m.split(".")[0] == "gockpt"]:
            del sys.modules[name]
        sys.meta_path.insert(0, NoGockpt())
    else:
        from gockpt.integrations import deepspeed as gockpt_ds
    run, rank = sc["run"], int(os.environ["RANK"])
    ck_dir = os.path.join(out_dir, "ckpt")
    writer = None
    if run == "kill":
        from tests._support.faulty_storage import killing_writer
        writer = killing_writer()
    elif sc.get("chunk_bytes"):  # checksum chunks this small: a partial read reads less
        import functools
        from gockpt import storage
        writer = functools.partial(storage.CheckpointWriter, chunk_bytes=sc["chunk_bytes"])
    if run in ("patched", "save", "resume", "native-load", "kill", "refused"):
        # "early": the saves' directory and spacing given to install(), so that the patch's
        # Checkpointer is made with the engine and the first save is copied ahead too
        early = {"directory": ck_dir, "interval": sc["save_at"][1] - sc["save_at"][0]} \
            if sc.get("early") and run == "save" else {}
        gockpt_ds.install(**sc.get("options", {}), **early,
                          **({"storage_writer": writer} if writer else {}))
    engine = build(sc)
    out = {"losses": []}
    if run == "refused":
        before = live_state(engine)
        try:
            engine.load_checkpoint(os.path.join(out_dir, sc.get("load_dir", "ckpt")))
        except Exception as exc:  # noqa: BLE001 -- the test reads which, and its message
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["unchanged"] = states_equal(before, live_state(engine))
    elif run in ("resume", "native-load", "plain-load"):
        # "load_dir": where to load from (default the "save" run's); "resave_at": steps the
        # resumed run saves again (into "resave_dir"), the live state at the last one dumped
        path, client = engine.load_checkpoint(os.path.join(out_dir, sc.get("load_dir", "ckpt")))
        if run == "plain-load":  # loaded without gockpt; its snapshots below may import it
            assert path is not None and not any(m.split(".")[0] == "gockpt" for m in sys.modules)
            sys.meta_path[:] = [h for h in sys.meta_path if not isinstance(h, NoGockpt)]
        out["client"], out["path"] = client, path
        out["loaded"] = live_state(engine)
        if run == "resume":  # which way it loaded, and what it read at another degree
            ours = gockpt_ds._patches[engine]
            out["resharded"], out["read_bytes"] = ours.restored.resharded, ours.read_bytes
        resaves = sc.get("resave_at", [])
        resave_dir = os.path.join(out_dir, sc.get("resave_dir", "ckpt2"))

        def again(step):
            if step in resaves:
                engine.save_checkpoint(resave_dir, client_state={"data_pos": step, "rank": rank})
            if resaves and step == resaves[-1]:
                out["live"] = live_state(engine)

        train(engine, sc, client["data_pos"] + 1, sc["steps"], out, again)
        if resaves:
            gockpt_ds.wait(engine)
    else:
        saves = sc["save_at"] if isinstance(sc["save_at"], list) else [sc["save_at"]]

        def at(step):  # "save" through gockpt, "native-save" DeepSpeed's own
            if run == "kill" and step in saves[:2]:
                engine.save_checkpoint(ck_dir, client_state={"data_pos": engine.global_steps,
                                                             "rank": rank})
                print(f"rank {rank}: waiting for the checkpoint of step {step}", flush=True)
                gockpt_ds.wait(engine)  # the second: rank 1 never votes; stopped here
                if step == saves[1]:
                    raise AssertionError("the checkpoint completed without rank 1")
                writer.armed = rank == 1
            if run in ("save", "native-save") and step in saves:
                # values of this step: the checkpoint must be this step's state ("log": a
                # callable, as the step log asks: each logged step's own values)
                client = {"data_pos": engine.global_steps, "rank": rank}
                if sc.get("log"):
                    from gockpt.core.errors import ConfigError
                    try:  # (a dict would be the save's step's only: refused with the log)
                        engine.save_checkpoint(ck_dir, client_state=client)
                    except ConfigError as exc:
                        out["refused"] = str(exc)
                engine.save_checkpoint(ck_dir, client_state=(
                    lambda: {"data_pos": engine.global_steps, "rank": rank})
                    if sc.get("log") else client)
            if step == saves[-1]:
                out["live"] = live_state(engine)
            if sc.get("lives"):  # the state at every step (what a restart at it must load)
                out.setdefault("lives", {})[step] = live_state(engine)

        train(engine, sc, 1, sc["steps"], out, at)
        if sc.get("leave_at_once"):  # committed, the Checkpointer left open (as by a crash)
            patch = gockpt_ds._patches[engine]
            patch.ck.wait()
            if patch.ck.steplog is not None:  # the last step's entry whole: a restart at it
                patch.flush()
                patch.ck.steplog.writer.flush()
        elif run == "save" and not sc.get("exit_without_wait"):
            gockpt_ds.wait(engine)
    out["final"] = live_state(engine)
    torch.save(out, os.path.join(out_dir, f"{run}-rank{rank}.pt"))
    if sc.get("leave_at_once"):  # as a crash leaves it: nothing closed, the memory tier kept
        print(f"rank {rank}: ok", flush=True)
        os._exit(0)
    if torch.distributed.is_initialized() and not sc.get("exit_without_wait"):
        # Without it gloo's threads may still hold work when the interpreter is torn down, and
        # the process aborts after its last line ("terminate called without an active
        # exception", pytorch/pytorch#190489).  A run that leaves its save to the exit hook keeps
        # the group: the hook's commit still needs it.
        torch.distributed.destroy_process_group()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
