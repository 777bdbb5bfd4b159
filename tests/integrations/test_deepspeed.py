"""gockpt.integrations.deepspeed: engine.save_checkpoint / load_checkpoint through gockpt.

Each case trains a tiny model with DeepSpeed's CPU accelerator in fresh processes (1 or 2 gloo
ranks, 4 for ZeRO 1 in gockpt-o; tests/_support/deepspeed_worker.py): uninterrupted, patched with checkpoints at steps 6,
12, 18 (the last one expected from their spacing), and resumed from 18.  Step 18 is chosen on
purpose: from t = 19 DeepSpeed's CPU Adam running
product beta2^t differs from pow(beta2, t), so a resume that does not rebuild the op's state
would drift (see gockpt/integrations/deepspeed/state.py: warm_cpu_adam).
"""

import gc
import json
import math
import os
import signal
import tempfile
import types
import warnings
import weakref

import pytest
import torch

import gockpt
from gockpt import storage
from tests._support.deepspeed_cases import (WORKER, assert_states_equal, check_checkpoint_and_resume,
                                            runs)
from tests._support.dist_ranks import start_ranks
from gockpt.core.errors import ConfigError

pytest.importorskip("deepspeed")  # installed by the README's setup: this never skips in CI

from gockpt.integrations import deepspeed as gockpt_ds  # noqa: E402
from gockpt.integrations.deepspeed.patch import holds_gockpt_checkpoint, watch_unscale  # noqa: E402
from gockpt.integrations.deepspeed.state import _numbers_of, check_record, restore_engine  # noqa: E402

GOCKPT_O = {"mode": "gockpt-o", "overlap_steps": 3, "block_bytes": 2048}  # window 16..18


@pytest.mark.slow
@pytest.mark.parametrize("stage,world,extra", [
    (0, 1, {}),
    (1, 2, {}),                                     # (ZeRO 2 on 2 ranks: in gockpt-o below)
    (1, 1, {"fp32_accumulation": True}),            # BF16_Optimizer
    (2, 1, {"gas": 2, "gockpt_section": {"keep_last": 2}}),
    (0, 1, {"options": GOCKPT_O}),                  # the replay of DeepSpeed's CPU Adam
    (0, 2, {"options": GOCKPT_O}),                  # replicas: everything in shares
    (1, 2, {"options": GOCKPT_O, "early": True}),   # module weights in shares, fp32 partitions;
                                                    # the Checkpointer made with the engine
    (2, 2, {"options": GOCKPT_O}),
    (1, 4, {"options": GOCKPT_O}),                  # ... on 4 ranks (replicas alone on 4:
                                                    # test_many_ranks' DDP)
    (2, 1, {"options": GOCKPT_O, "gas": 2}),
    (1, 1, {"options": GOCKPT_O, "two_groups": True}),  # the base optimizer steps per group
    (1, 2, {"options": {**GOCKPT_O, "emulate_link_gbps": 1.0}}),  # across a link: bf16
    (2, 1, {"options": {**GOCKPT_O, "grad_transport": "bf16"}, "two_groups": True}),
    (1, 1, {"options": GOCKPT_O, "torch_adam": True}),  # torch's AdamW as base optimizer
])
def test_checkpoint_is_the_state_at_f_and_resumes_bitwise(tmp_path, stage, world, extra):
    # ZeRO 1/2 in bf16 hand the optimizer bf16 gradients times one coefficient: asked for (or
    # across a link), the replayed gradients cross in bf16; by default on the CPU in fp32.
    options = extra.get("options", {})
    transport = None
    if options.get("mode") == "gockpt-o":
        bf16 = options.get("grad_transport") == "bf16" or (
            "emulate_link_gbps" in options and stage in (1, 2))
        transport = "bf16" if bf16 else "fp32"
    check_checkpoint_and_resume(tmp_path, stage, world, extra, transport)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_a_rank_killed_while_writing_its_part_leaves_the_previous_latest(tmp_path, stage):
    # the checkpoint of step 6 commits; in the write of step 8's, rank 1 dies
    scenario = {"stage": stage, "steps": 10, "save_at": [6, 8], "options": GOCKPT_O}
    procs = start_ranks(tmp_path, json.dumps({**scenario, "run": "kill"}), 2, WORKER)
    out1, err1 = procs[1].communicate(timeout=300)
    assert procs[1].returncode == -signal.SIGKILL and "rank 1: killed in the write" in out1, \
        (out1, err1)
    procs[0].kill()  # as torchrun stops the job when one of its ranks dies
    out0, _ = procs[0].communicate(timeout=60)
    assert "rank 0: waiting for the checkpoint of step 8" in out0 and "rank 0: ok" not in out0
    directory = str(tmp_path / "ckpt")
    assert storage.list_checkpoints(directory) == ["step-000000006"]
    assert os.path.basename(storage.resolve(directory)) == "step-000000006"
    assert gockpt.verify(directory).ok
    # resumed on the same two ranks from what is latest: bit for bit the uninterrupted run
    one = runs(tmp_path, 2, **scenario)
    plain, resumed = one("plain"), one("resume")
    for r in range(2):
        assert resumed[r]["client"] == {"data_pos": 6, "rank": r}
        assert resumed[r]["losses"] == plain[r]["losses"][6:]
        assert_states_equal(resumed[r]["final"], plain[r]["final"], f"rank {r}: resumed vs plain")


# One checkpoint at step 6 of 9 (the replay windows are the other tests' matter): loaded at
# another degree, then three more steps
RESHARD_AT, RESHARD_STEPS = 6, 9
RESHARD = {"steps": RESHARD_STEPS, "save_at": [RESHARD_AT], "width": 1024, "chunk_bytes": 4096}


@pytest.mark.slow
@pytest.mark.parametrize("saved,loaded,extra", [
    pytest.param((1, 2), (1, 1), {}, id="zero1-2to1"),
    pytest.param((1, 1), (1, 2), {}, id="zero1-1to2"),
    pytest.param((1, 2), (1, 4), {}, id="zero1-2to4"),
    pytest.param((1, 4), (1, 2), {}, id="zero1-4to2"),
    pytest.param((1, 2), (2, 1), {}, id="zero1-2-to-zero2-1"),
    pytest.param((2, 1), (1, 2), {}, id="zero2-1-to-zero1-2"),
    pytest.param((1, 2), (1, 4), {"two_groups": True}, id="zero1-2to4-two-groups"),
])
def test_zero_checkpoint_resumes_at_another_data_parallel_degree(tmp_path, tmp_path_factory,
                                                                 saved, loaded, extra):
    """A ZeRO checkpoint of N ranks (stage, N) = ``saved`` loaded by engine.load_checkpoint on
    M ranks (stage, M) = ``loaded``: the fp32 masters and both moments, put together from
    every rank's partition, equal the saving run's at F bit for bit, as do the module's
    weights on every rank, the step counters, the engine's counters, the scheduler and
    client_state (rank 0's); each rank reads about 1/M of the stored fp32 state (within 20%);
    then training goes on."""
    (stage, n), (new_stage, m) = saved, loaded
    ckpt, live = _saved_once(tmp_path_factory, stage, n, extra)
    resumed = runs(tmp_path, m, stage=new_stage, **RESHARD, **extra, load_dir=ckpt)("resume")
    loaded_states = [r["loaded"] for r in resumed]
    want, got = _whole_fp32(live), _whole_fp32(loaded_states)
    assert want.keys() == got.keys()
    for (param, what), t in want.items():
        assert torch.equal(t.view(torch.int32), got[param, what].view(torch.int32)), \
            f"{what} of {param} differs from the saving run's at F"
    for r, (res, st) in enumerate(zip(resumed, loaded_states)):
        weights = {k: v for k, v in st["tensors"].items() if k.startswith("module.")}
        saved_weights = {k: v for k, v in live[0]["tensors"].items() if k.startswith("module.")}
        assert weights.keys() == saved_weights.keys()
        for k, v in weights.items():
            assert torch.equal(v.view(-1).view(torch.uint8),
                               saved_weights[k].view(-1).view(torch.uint8)), f"rank {r}: {k}"
        steps = {k: v for k, v in st["optimizer"].items() if k.endswith("/step")}
        assert steps and steps == {k: v for k, v in live[0]["optimizer"].items()
                                   if k.endswith("/step")}, f"rank {r}: step counters"
        assert st["counters"] == live[0]["counters"] and st["scheduler"] == live[0]["scheduler"]
        assert res["client"] == {"data_pos": RESHARD_AT, "rank": 0}
        assert res["resharded"] is True
        read = res["read_bytes"]
        assert abs(read["fp32"] - read["fp32_stored"] / m) <= 0.2 * read["fp32_stored"] / m, \
            f"rank {r} read {read['fp32']} of {read['fp32_stored']} stored fp32 bytes on {m}"
        # training goes on: the steps after F run, and the replicas' weights stay alike
        assert len(res["losses"]) == RESHARD_STEPS - RESHARD_AT and \
            all(map(math.isfinite, res["losses"]))
        assert all(torch.equal(v, resumed[0]["final"]["tensors"][k])
                   for k, v in res["final"]["tensors"].items() if k.startswith("module."))
    final = _whole_fp32([r["final"] for r in resumed])
    assert any(not torch.equal(t, final[key]) for key, t in got.items() if key[1] == "fp32")


_saves = {}  # (stage, ranks, extra) -> (its checkpoint directory, the live states at F)


def _saved_once(tmp_path_factory, stage, n, extra):
    """The saving run of (stage, n ranks, ``extra``), run once per session: several cases
    load the same checkpoint (it is only read)."""
    key = json.dumps([stage, n, extra], sort_keys=True)
    if key not in _saves:
        directory = tmp_path_factory.mktemp("zero-save")
        states = runs(directory, n, stage=stage, **RESHARD, **extra)("save")
        _saves[key] = (str(directory / "ckpt"), [r["live"] for r in states])
    return _saves[key]


def _whole_fp32(states):
    """(parameter, "fp32" | moment) -> the whole fp32 tensor, put together from each rank's
    partition in ``states`` (live_state snapshots) by where its layout puts each fragment;
    every element exactly once."""
    out, filled = {}, {}
    for st in states:
        masters = {k: v for k, v in st["tensors"].items() if k.startswith("master_")}
        moments = {}  # group -> key -> its flat moment (DeepSpeed's state i is group i's)
        for k, v in st["optimizer"].items():
            i, key = k.split("/", 1)
            if key != "step":
                moments.setdefault(int(i), {})[key] = v
        for param, (gi, start, first, numel, shape) in st["layout"].items():
            for what, flat in [("fp32", masters[f"master_g{gi}_p0"]), *moments[gi].items()]:
                whole = out.setdefault((param, what), torch.zeros(math.prod(shape)))
                seen = filled.setdefault((param, what), torch.zeros(math.prod(shape), dtype=torch.int8))
                whole[first:first + numel] = flat[start:start + numel]
                seen[first:first + numel] += 1
    assert all(bool((seen == 1).all()) for seen in filled.values()), "fragments overlap or miss"
    return out


@pytest.mark.slow
def test_a_zero_checkpoint_of_another_model_is_refused_at_another_degree_before_any_change(
        tmp_path):
    """ZeRO 1 saved on 2 ranks with a hidden layer of 48, loaded on 1 with one of 32: a
    LoadError naming the first parameter that differs, and the engine as it was."""
    scenario = {"stage": 1, "steps": 8, "save_at": [6]}
    runs(tmp_path, 2, **scenario)("save")
    (res,) = runs(tmp_path, 1, **scenario, width=32)("refused")
    assert res["error"].startswith("LoadError: ") and "'module.0.weight'" not in res["error"] \
        and "'0.weight' has shape [48, 16] in the checkpoint but [32, 16]" in res["error"], \
        res["error"]
    assert res["unchanged"]


@pytest.mark.slow
def test_a_damaged_piece_read_by_one_rank_fails_the_load_on_every_rank(tmp_path):
    """ZeRO 1 saved on 1 rank, loaded on 2: a byte flipped in the fp32 master where only rank
    1's partition reads it. Rank 1 names the damage; rank 0, which read its own pieces
    intact, fails too instead of training on into a collective that never completes."""
    from gockpt.storage import manifest as manifest_mod
    scenario = {"stage": 1, "steps": 8, "save_at": [6], "width": 1024, "chunk_bytes": 4096}
    runs(tmp_path, 1, **scenario)("save")
    path, m = manifest_mod.read(storage.resolve(str(tmp_path / "ckpt")), 0)
    entry = m.tensors[m.model.params["master_g0_p0"].tensor]
    with open(os.path.join(path, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + entry["nbytes"] * 3 // 4)  # in rank 1's half, no padding
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    errors = [r["error"] for r in runs(tmp_path, 2, **scenario)("refused")]
    assert errors[1].startswith("CorruptCheckpointError: ") and "partly overwritten" in \
        errors[1], errors
    assert errors[0].startswith("LoadError: ") and "another rank could not read" in \
        errors[0], errors


@pytest.mark.slow
@pytest.mark.parametrize("betas,stage,world", [
    ((0.9, 0.95), 1, 2),   # the usual LLM setting, ZeRO 1 on 2 ranks
    ((0.9, 0.99), 0, 1),   # (0.98 and others: the probe's own test, test_deepspeed_adapter)
])
def test_llm_betas_save_resume_save_again_bitwise(tmp_path, betas, stage, world):
    """DeepSpeed's CPU Adam with the betas LLMs use, in gockpt-o: a run saves at 6, 12, 18
    (the last over a window), a fresh process resumes from 18 and saves at 21, 24, 27 (the
    last over a window again, after the op's products were rebuilt), a third resumes from 27:
    each checkpoint is the live state at its step, every run continues bit for bit. Before,
    the op's products could not be read (a probe on parameters near 1 with lr 1e-3 did not
    see one ulp of a bias correction, and both candidates matched): the save raised
    UnsupportedOptimizerError in the middle of training."""
    one = runs(tmp_path, world, stage=stage, steps=30, save_at=[6, 12, 18], betas=list(betas),
               options=GOCKPT_O)
    plain, saved = one("plain"), one("save")
    resumed = one("resume", resave_at=[21, 24, 27])
    again = one("resume", load_dir="ckpt2", resave_at=[])
    for r in range(world):
        assert saved[r]["losses"] == plain[r]["losses"]
        assert_states_equal(resumed[r]["loaded"], saved[r]["live"], f"rank {r}: loaded 18")
        assert resumed[r]["losses"] == plain[r]["losses"][18:]
        assert_states_equal(again[r]["loaded"], resumed[r]["live"], f"rank {r}: loaded 27")
        assert again[r]["losses"] == plain[r]["losses"][27:]
        assert_states_equal(again[r]["final"], plain[r]["final"], f"rank {r}: final")
    import gockpt
    for ckpt in ("ckpt", "ckpt2"):  # the windowed saves were replayed, not copied
        records = gockpt.metrics.read(str(tmp_path / ckpt), rank=0)
        assert [m["overlap_steps"] for m in records] == [1, 1, 3], ckpt
        assert records[-1]["grad_steps"] == 2


@pytest.mark.slow
def test_native_checkpoints_still_load_through_the_patched_engine(tmp_path):
    one = runs(tmp_path, 1, stage=1, steps=8, save_at=4)
    saved = one("native-save")
    loaded = one("native-load")
    assert not holds_gockpt_checkpoint(tmp_path / "ckpt", None)
    assert_states_equal(loaded[0]["loaded"], saved[0]["live"], "native load")
    assert loaded[0]["client"]["data_pos"] == 4


@pytest.mark.slow
def test_the_engine_loads_the_memory_tiers_copy(tmp_path):
    # Config(memory=...) through the patch: a process that ended without closing anything (a
    # crash) leaves its newest checkpoint in the memory tier, which engine.load_checkpoint
    # takes -- the disk's copy, damaged here, is not read -- and training goes on bit for bit
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="gockpt-test-shm-", dir=base) as shm:
        options = {"memory": "auto", "memory_dir": shm}
        one = runs(tmp_path, 1, stage=1, steps=8, save_at=4, options=options)
        saved = one("save", leave_at_once=True)
        step = tmp_path / "ckpt" / "step-000000004"
        entry = next(iter(json.loads((step / "manifest.json").read_text())["tensors"].values()))
        with open(step / entry["file"], "r+b") as f:  # a byte of a stored tensor, flipped
            f.seek(entry["offset"] + entry["nbytes"] // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        resumed = one("resume")
        plain = one("plain")
    assert os.path.realpath(resumed[0]["path"]).startswith(os.path.realpath(shm))
    assert_states_equal(resumed[0]["loaded"], saved[0]["live"], "loaded from memory vs live")
    assert resumed[0]["losses"] == plain[0]["losses"][4:]
    assert_states_equal(resumed[0]["final"], plain[0]["final"], "resumed vs plain")


@pytest.mark.slow
@pytest.mark.parametrize("stage,world,extra", [
    (1, 1, {}), (2, 2, {}),
    (1, 1, {"fp16": True, "inf_at": 6})])  # (an overflow in the log: step 6 skipped, logged so)
def test_a_crashed_engine_restarts_at_its_last_logged_step(tmp_path, stage, world, extra):
    # Config(memory_log=...) through the patch: a checkpoint at step 4, then steps 5..7 in the
    # step log (each rank its own partition's gradients; ZeRO steps its base optimizer one
    # param group at a time); the process ends closing nothing (a crash) with step 7's entry
    # whole. engine.load_checkpoint loads step 4 and replays 5..7 -- the base optimizer's
    # steps, then the module's weights gathered from the fp32 masters -- to the live state of
    # step 7 with its own client_state, and training goes on bit for bit
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="gockpt-test-shm-", dir=base) as shm:
        options = {"memory": "auto", "memory_dir": shm, "memory_log": 64 << 20}
        one = runs(tmp_path, world, stage=stage, steps=7, save_at=4, options=options,
                   two_groups=True, **extra)
        saved = one("save", leave_at_once=True, log=True, lives=True)
        resumed = one("resume", steps=9)
        plain = one("plain", steps=9, options={})
    for r in range(world):
        assert "give client_state as a callable" in saved[r]["refused"]  # (a dict, first)
        assert resumed[r]["client"] == {"data_pos": 7, "rank": r}, resumed[r]["client"]
        path = resumed[r]["path"]  # (the log's entry; on several ranks each rank's own log)
        assert path.startswith(os.path.realpath(shm)) and f"{os.sep}log{os.sep}" in path and \
            path.endswith("step-000000007"), path
        assert_states_equal(resumed[r]["loaded"], saved[r]["lives"][7], "replayed vs live at 7")
        assert resumed[r]["losses"] == plain[r]["losses"][7:]
        assert_states_equal(resumed[r]["final"], plain[r]["final"], "resumed vs plain")


@pytest.mark.slow
def test_a_save_right_before_the_script_ends_is_committed_at_exit(tmp_path):
    import gockpt
    runs(tmp_path, 1, stage=1, steps=3, save_at=3, exit_without_wait=True)("save")
    assert holds_gockpt_checkpoint(tmp_path / "ckpt", None)
    assert gockpt.verify(str(tmp_path / "ckpt")).ok


def test_the_registry_of_patched_engines_lets_a_dropped_engine_go():
    class Engine:  # what patch() reads of an engine before its first checkpoint
        optimizer = None
        _config = types.SimpleNamespace(_param_dict={})

        def zero_optimization_stage(self):
            return 1

        def forward(self, x):
            return x

        backward = step = save_checkpoint = load_checkpoint = forward

    engine = Engine()
    gockpt_ds.patch(engine, mode="async")
    assert gockpt_ds._patches[engine].engine is engine and engine.forward(3) == 3
    freed = weakref.ref(engine)
    del engine
    gc.collect()
    assert freed() is None and len(gockpt_ds._patches) == 0


# ---------------------------------------------------------------------- options, refusals

def fake_engine(stage=1, section=None, optimizer=None):
    e = types.SimpleNamespace(zero_optimization_stage=lambda: stage)
    if optimizer is not None:  # (the wrapper DeepSpeed made)
        e.optimizer = optimizer
    e._config = types.SimpleNamespace(_param_dict={} if section is None else {"gockpt": section})
    return e


def test_options_default_to_async_o_and_come_from_the_config_section():
    assert gockpt_ds._options(fake_engine(), {})["mode"] == "async-o"
    opts = gockpt_ds._options(fake_engine(section={"keep_last": 3, "mode": "async"}),
                              {"mode": "sync"})
    assert opts == {"keep_last": 3, "mode": "sync"}  # arguments win over the section


@pytest.mark.parametrize("on_gpu,options,expected", [
    (True, {}, "bf16"), (False, {}, None), (False, {"emulate_link_gbps": 2.0}, "bf16"),
    (True, {"grad_transport": "fp32"}, "fp32")])
def test_gradients_cross_in_bf16_by_default_where_a_link_carries_them(monkeypatch, on_gpu,
                                                                     options, expected):
    monkeypatch.setattr(gockpt_ds, "_replay_refusal", lambda engine: None)
    monkeypatch.setattr(gockpt_ds, "zero_bf16", lambda engine: True)
    monkeypatch.setattr(gockpt_ds, "_on_gpu", lambda engine: on_gpu)
    assert gockpt_ds._options(fake_engine(), {"mode": "gockpt-o", **options}).get(
        "grad_transport") == expected
    assert "grad_transport" not in gockpt_ds._options(fake_engine(), {"mode": "async-o"})


@pytest.mark.parametrize("engine,options,match", [
    (fake_engine(stage=3), {}, "ZeRO stage 3"),
    (fake_engine(), {"mode": "gockpt-o"}, "cannot replay"),
    (fake_engine(section={"mode": "gockpt"}), {}, "cannot replay"),
    (fake_engine(), {"block_bytes": -1}, "block_bytes"),
    (fake_engine(), {"directory": 5}, "directory must be a path"),  # (a path: made with the engine)
    # (FP16_Optimizer, ZeRO 0 in fp16: no update of the module's weights a replay can call)
    (fake_engine(optimizer=types.SimpleNamespace()), {"memory": "auto", "memory_log": 1 << 20},
     "memory_log needs ZeRO 1/2 or bf16"),
])
def test_what_cannot_be_checkpointed_exactly_is_refused_at_patch_time(engine, options, match):
    with pytest.raises(ConfigError, match=match):
        gockpt_ds._options(engine, options)


def test_the_step_log_takes_the_engines_own_update_of_its_weights():
    lp = types.SimpleNamespace(update_lp_params=lambda: None)  # (ZeRO 1/2, BF16_Optimizer)
    opts = gockpt_ds._options(fake_engine(optimizer=lp), {"memory": "auto", "memory_log": 1})
    assert opts["memory_log"] == 1


def test_fallback_replaces_a_replay_mode_by_async_o_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opts = gockpt_ds._options(fake_engine(), {"mode": "gockpt-o", "fallback": True})
    assert opts["mode"] == "async-o" and len(caught) == 1
    assert "cannot replay" in str(caught[0].message)


def test_the_unscale_multiplier_is_probed_only_when_a_checkpoint_asks():
    class DeepSpeedZeroOptimizer:  # ZeRO's unscale: clipping by 4, loss scale 1
        calls = 0

        def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
            type(self).calls += 1
            for g in grad_groups_flat:
                g.data.mul_(1.0 / (total_norm / 0.5))

    wrapper, patch = DeepSpeedZeroOptimizer(), types.SimpleNamespace(multiplier=None)
    assert watch_unscale(wrapper, patch)
    for _ in range(3):  # steps with no checkpoint recording them: no probe
        grads = torch.full((3,), 8.0)
        wrapper.unscale_and_clip_grads([grads], torch.tensor(2.0))
    assert DeepSpeedZeroOptimizer.calls == 3 and grads.tolist() == [2.0] * 3
    assert patch.multiplier().item() == 0.25 and DeepSpeedZeroOptimizer.calls == 4


def test_loss_scaler_numbers_round_trip():
    scaler = types.SimpleNamespace(cur_scale=65536.0, cur_iter=7, dynamic=True,
                                   last_overflow_iter=-1, name="dyn", t=torch.tensor(2.0))
    numbers = _numbers_of(scaler)
    assert numbers == {"cur_scale": 65536.0, "cur_iter": 7, "dynamic": True,
                       "last_overflow_iter": -1, "t": 2.0}
    target = types.SimpleNamespace(cur_scale=1.0, cur_iter=0, dynamic=False, last_overflow_iter=3)
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(loss_scaler=target),
                                   global_steps=0)
    restore_engine(engine, {"counters": {"global_steps": 9},
                            "scalers": {"loss_scaler": {"cur_scale": 8.0, "cur_iter": 7}}})
    assert engine.global_steps == 9 and target.cur_scale == 8.0 and target.cur_iter == 7
    # a scaler the engine's optimizer lacks: refused for fp16 (before anything is loaded),
    # left out for bf16 (nothing is scaled; BF16_Optimizer keeps no loss scaler)
    record = {"counters": {}, "scalers": {"loss_scale_config": {"cur_scale": 4.0}}}
    engine.bfloat16_enabled = lambda: False
    with pytest.raises(gockpt.LoadError, match="CKPT: .*loss_scale_config"):
        check_record(engine, record, "CKPT")
    engine.bfloat16_enabled = lambda: True
    check_record(engine, record, "CKPT")
    restore_engine(engine, record)
    assert not hasattr(engine.optimizer, "loss_scale_config") and target.cur_scale == 8.0


def test_holds_gockpt_checkpoint_reads_latest_or_the_tag(tmp_path):
    assert not holds_gockpt_checkpoint(tmp_path, None)
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "latest").write_text("global_step4")
    assert not holds_gockpt_checkpoint(tmp_path, None)           # DeepSpeed's own
    (tmp_path / "step-000000009").mkdir()
    (tmp_path / "step-000000009" / "manifest.json").write_text("{}")
    assert holds_gockpt_checkpoint(tmp_path, "step-000000009")
    assert not holds_gockpt_checkpoint(tmp_path, None)           # latest names the native one
    (tmp_path / "latest").write_text("step-000000009")
    assert holds_gockpt_checkpoint(tmp_path, None)
