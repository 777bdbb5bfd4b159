"""gockpt.integrations.deepspeed.export_config: what of the DeepSpeed config decides the layout
of ``gockpt export --to deepspeed`` (given, recorded, or both checked against each other).
No DeepSpeed engine: configs as dicts, as a checkpoint records them."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gockpt.core.errors import ConfigError
from gockpt.integrations.deepspeed import export_config as X
from gockpt.integrations.deepspeed.export_config import (RECORDED, choose, load_config,
                                                         settings_of, wrapper_kind)

GIVEN = "--ds-config ds.json"


def config(**top):
    """ZeRO 1 in bf16 with clipping; ``top`` replaces top-level keys (None: removes one)."""
    out = {"train_batch_size": 8, "zero_optimization": {"stage": 1},
           "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    for k, v in top.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------ settings_of

def test_settings_of_reads_what_decides_the_layout():
    c = config()
    s = settings_of(c, GIVEN)
    assert (s.stage, s.dtype, s.clip, s.fp32_accumulation, s.offload) == \
        (1, torch.bfloat16, 1.0, False, False)
    assert s.config is c and s.source == GIVEN
    s = settings_of(config(bf16=None, fp16={"enabled": True}, gradient_clipping=None,
                           zero_optimization=None), GIVEN)
    assert (s.stage, s.dtype, s.clip) == (0, torch.float16, 0.0)  # DeepSpeed's defaults
    assert settings_of(config(bf16=None, bfloat16={"enabled": True}), GIVEN).dtype is \
        torch.bfloat16


def test_settings_of_fp32_accumulation_and_offload():
    accum = {"grad_accum_dtype": "fp32"}
    assert settings_of(config(data_types=accum), GIVEN).fp32_accumulation
    assert not settings_of(config(data_types={"grad_accum_dtype": "bf16"}), GIVEN) \
        .fp32_accumulation
    fp16 = config(bf16=None, fp16={"enabled": True}, data_types=accum)
    assert not settings_of(fp16, GIVEN).fp32_accumulation  # bf16 only
    for zero, offload in (({"stage": 2, "cpu_offload": True}, True),
                          ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, True),
                          ({"stage": 2, "offload_optimizer": {"device": "none"}}, False),
                          ({"stage": 2, "cpu_offload": "yes"}, False)):
        assert settings_of(config(zero_optimization=zero), GIVEN).offload is offload, zero


@pytest.mark.parametrize("change,what", [
    ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
    ({"zero_optimization": {"stage": 1, "elastic_checkpoint": True}},
     "zero_optimization.elastic_checkpoint"),
    ({"zero_optimization": {"stage": 2, "round_robin_gradients": True}},
     "zero_optimization.round_robin_gradients"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "NVMe optimizer offload"),
    ({"bf16": None}, r"fp32 training \(neither bf16 nor fp16 enabled\)"),
    ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, "fp32 training"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "ZeRO stage 3"),  # the first refusal is named
])
def test_settings_of_refuses_what_cannot_be_exported(change, what):
    with pytest.raises(ConfigError, match=f"{GIVEN}: --to deepspeed does not export {what}"):
        settings_of(config(**change), GIVEN)


@pytest.mark.parametrize("change", [
    {"zero_optimization": {"stage": "auto"}}, {"bf16": {"enabled": "auto"}},
    {"fp16": {"enabled": "auto"}}, {"gradient_clipping": "auto"},
    {"gradient_clipping": True}, {"zero_optimization": {"stage": 4}},
    {"zero_optimization": {"stage": True}}, {"zero_optimization": {"stage": 1.0}},
])
def test_settings_of_refuses_auto_and_odd_values(change):
    with pytest.raises(ConfigError, match=r"must be given as values \(not 'auto'\)"):
        settings_of(config(**change), GIVEN)


def test_settings_of_refuses_an_offload_section_that_is_not_an_object():
    with pytest.raises(ConfigError, match="'zero_optimization.offload_optimizer' is not an object"):
        settings_of(config(zero_optimization={"stage": 2, "offload_optimizer": "cpu"}), GIVEN)


def test_settings_of_refuses_a_section_that_is_not_an_object():
    with pytest.raises(ConfigError, match="'fp16' is not an object"):
        settings_of(config(fp16=[True]), GIVEN)


def test_differences_name_what_differs_with_the_recorded_value():
    a = settings_of(config(), GIVEN)
    assert a.differences(settings_of(copy.deepcopy(config()), RECORDED)) == []
    b = settings_of(config(zero_optimization={"stage": 2, "cpu_offload": True}, bf16=None,
                           fp16={"enabled": True}, gradient_clipping=0.5), RECORDED)
    assert a.differences(b) == ["zero_optimization.stage 1 (recorded: 2)",
                                "precision bf16 (recorded: fp16)",
                                "gradient_clipping 1.0 (recorded: 0.5)",
                                "optimizer offload False (recorded: True)"]
    c = settings_of(config(data_types={"grad_accum_dtype": "fp32"}), RECORDED)
    assert a.differences(c) == [
        "fp32 gradient accumulation (data_types.grad_accum_dtype) False (recorded: True)"]


# ------------------------------------------------------------------ choose

def test_choose_the_recorded_config_when_none_is_given():
    s, notes = choose(None, "ck", {"ds_config": config()})
    assert (s.source, s.stage, notes) == (RECORDED, 1, [])


def test_choose_the_given_config_that_agrees_with_the_recorded_one():
    given = settings_of(config(), GIVEN)
    assert choose(given, "ck", {"ds_config": config(train_batch_size=16)}) == (given, [])
    assert choose(given, "ck", {}) == (given, [])  # nothing recorded: the given one
    assert choose(given, "ck", {"ds_config": None, "ds_config_dropped": []}) == (given, [])


def test_choose_refuses_a_given_config_that_disagrees():
    given = settings_of(config(zero_optimization={"stage": 2}), GIVEN)
    with pytest.raises(ConfigError, match=rf"{GIVEN} disagrees with {RECORDED} on what decides "
                       r"the layout: zero_optimization.stage 2 \(recorded: 1\)\. Leave "
                       "--ds-config out"):
        choose(given, "ck", {"ds_config": config()})


def test_choose_without_any_config_says_why():
    with pytest.raises(ConfigError, match="ck: the DeepSpeed config was written by a gockpt "
                       "that did not record it; pass --ds-config"):
        choose(None, "ck", {})
    dropped = [{"path": [], "type": "Namespace"}]
    with pytest.raises(ConfigError, match=r"could not be recorded \(the config: Namespace\)"):
        choose(None, "ck", {"ds_config": None, "ds_config_dropped": dropped})


def test_choose_with_keys_lost_outside_the_layout_notes_them():
    dropped = [{"path": ["optimizer", "params", "betas"], "type": "tuple"}]
    s, notes = choose(None, "ck", {"ds_config": config(), "ds_config_dropped": dropped})
    assert s.source == RECORDED
    assert notes == [f"{RECORDED} lacks optimizer.params.betas: tuple (not storable without "
                     "pickle); ds_config is written without it"]
    given = settings_of(config(), GIVEN)
    assert choose(given, "ck", {"ds_config": config(), "ds_config_dropped": dropped}) == \
        (given, [])  # checked: what was lost does not decide the layout


def test_choose_with_layout_keys_lost_needs_the_given_config():
    dropped = [{"path": ["zero_optimization", "offload_optimizer"], "type": "Device"},
               "odd entry"]
    record = {"ds_config": config(), "ds_config_dropped": dropped}
    with pytest.raises(ConfigError, match=r"lacks what gockpt could not store of it "
                       r"\(zero_optimization.offload_optimizer: Device\), which decides the "
                       "layout; pass --ds-config"):
        choose(None, "ck", record)
    given = settings_of(config(zero_optimization={"stage": 2}), GIVEN)  # differs: not checked
    assert choose(given, "ck", record) == (given, [
        f"--ds-config not checked against {RECORDED}: it lacks "
        "zero_optimization.offload_optimizer: Device"])


def test_dropped_text_names_five_and_counts_the_rest():
    dropped = [{"path": ["a", i], "type": "T"} for i in range(7)] + ["x"]
    assert X.dropped_text(dropped) == "a.0: T, a.1: T, a.2: T, a.3: T, a.4: T and 3 more"
    assert X.dropped_text(["x"]) == "'x'"


# ------------------------------------------------------------------ wrapper_kind, check_dtype

def settings(stage, *, accum=False, offload=False):
    zero = {"stage": stage, **({"cpu_offload": True} if offload else {})}
    return settings_of(config(zero_optimization=zero,
                              data_types={"grad_accum_dtype": "fp32" if accum else "bf16"}),
                       GIVEN)


@pytest.mark.parametrize("s,cls,scalers,kind", [
    (settings(0), "FusedAdam", {"loss_scale_config": {}}, X.STAGE0),
    (settings(0), "Adam", {"loss_scale_config": {}}, X.UNFUSED),
    (settings(1, accum=True), "FusedAdam", {}, X.BF16),
    (settings(1), "FusedAdam", {"loss_scaler": {}}, X.ZERO),
    (settings(2, accum=True), "FusedAdam", {"loss_scaler": {}}, X.ZERO),
    (settings(1, accum=True, offload=True), "DeepSpeedCPUAdam", {"loss_scaler": {}}, X.ZERO),
])
def test_wrapper_kind_of_each_wrapper(s, cls, scalers, kind):
    assert wrapper_kind(s, cls, scalers) == kind


@pytest.mark.parametrize("s,scalers,built,written", [
    (settings(2), {}, "DeepSpeedZeroOptimizer",
     r"BF16_Optimizer \(ZeRO 1, fp32 gradient accumulation\)"),
    (settings(1, accum=True), {"loss_scaler": {}}, "BF16_Optimizer",
     "ZeRO 1/2's DeepSpeedZeroOptimizer"),
    (settings(0), {"loss_scaler": {}}, "FP16_Optimizer", "ZeRO 1/2's DeepSpeedZeroOptimizer"),
    (settings(1), {"loss_scale_config": {}}, "DeepSpeedZeroOptimizer",
     "stage 0's FP16_Optimizer"),
])
def test_wrapper_kind_refuses_a_config_that_builds_another_wrapper(s, scalers, built, written):
    with pytest.raises(ConfigError, match=rf"{GIVEN} \(ZeRO stage {s.stage}\) builds {built}, "
                       rf"the checkpoint was written by {written}; give the config"):
        wrapper_kind(s, "FusedAdam", scalers)


def test_check_dtype():
    s = settings_of(config(), GIVEN)
    X.check_dtype(s, {torch.bfloat16})
    X.check_dtype(s, set())  # no module weights to check
    with pytest.raises(ConfigError, match=f"{GIVEN} trains in bf16, the checkpoint's module "
                       "weights are fp16"):
        X.check_dtype(s, {torch.float16})


# ------------------------------------------------------------------ load_config

def test_load_config(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps(config()))
    assert load_config(str(good)) == config()
    missing = tmp_path / "none.json"
    with pytest.raises(ConfigError, match=f"--ds-config {missing}: .*No such file"):
        load_config(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 1")
    with pytest.raises(ConfigError, match=rf"--ds-config {bad}: not JSON \("):
        load_config(str(bad))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"--ds-config {listed}: not a JSON object"):
        load_config(str(listed))
    with pytest.raises(ConfigError, match=f"--ds-config {tmp_path}: "):
        load_config(str(tmp_path))  # a directory: the system's error, one line
