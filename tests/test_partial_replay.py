"""Partial replay: where an arithmetic profile reproduces an optimizer's moments but not its
parameter line (DeepSpeed's CUDA FusedAdam, torch's fused CUDA AdamW with weight decay at odd
element counts), the moments are replayed over the window and the parameter is copied at F,
with the last capture group.

No GPU here: a test-only profile -- torch's CPU AdamW claiming its moments only for chosen
parameters -- sends those parameters down the copy-at-F path; every committed checkpoint must
still be the live state at F bit for bit, with the verification on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gockpt import storage
from gockpt.core.plan import Plan
from gockpt.core.planning import build_plan
from gockpt.replay import adapters
from tests._support.loops import Run, loaded, same


class MomentsOnly(adapters.AdamAdapter):
    """torch's CPU AdamW with the parameter line of the parameters ``pick`` chooses marked as
    not reproduced (a test-only arithmetic profile)."""

    pick = staticmethod(lambda p: True)

    def params_not_replayed(self):
        return {id(p): "test profile: the parameter line is not claimed"
                for g in self.optimizer.param_groups for p in g["params"] if self.pick(p)}


@pytest.fixture
def moments_only(monkeypatch):
    def use(pick):
        monkeypatch.setattr(MomentsOnly, "pick", staticmethod(pick))
        monkeypatch.setattr(adapters, "adapter_for", MomentsOnly)
    return use


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 7), nn.GELU(),
                          nn.Linear(7, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)


def train(tmp_path, mode, **options):
    model, opt = model_and_opt()
    x = torch.randn(16, 6, 12, generator=torch.Generator().manual_seed(3))
    run = Run(model, opt, tmp_path, mode=mode, overlap_steps=3, block_bytes=64, verify=True,
              step_fn=lambda s: model(x[s]).square().mean(), **options)
    run.train(0, 14, at={5, 9, 13})
    run.close()
    return run


def every_commit_is_the_state_at_f(run, directory):
    for f in run.committed():
        model, opt = model_and_opt()
        why = same(run.at_f[f], loaded(directory, model, opt, tag=storage.checkpoint_name(f)))
        assert why is None, f"checkpoint of step {f}: {why}"
    return run.committed()


@pytest.mark.parametrize("mode", ["gockpt", "gockpt-o"])
@pytest.mark.parametrize("which", ["all", "weights"])
@pytest.mark.parametrize("device", ["host", "adversarial"])
def test_parameters_copied_at_f_and_moments_replayed_give_the_state_at_f(
        tmp_path, moments_only, monkeypatch, mode, which, device):
    """On the CPU device and on the simulated asynchronous one copying as late as allowed
    (there, a block whose moments reached F was once streamed to the file before the last
    group's copy of its parameter had landed: a committed checkpoint with stale parameters)."""
    if device != "host":
        monkeypatch.setenv("GOCKPT_SIMULATED_DEVICE", device)
    moments_only((lambda p: True) if which == "all" else (lambda p: p.dim() == 2))
    run = train(tmp_path, mode)
    plan = run.ck.plan
    late = [s.name for s in plan.slots if s.param_at_f]
    expected = [n for n, p in run.model.named_parameters()
                if which == "all" or p.dim() == 2]
    assert late == expected and late
    # the windows did replay: K = 3 groups, and blocks of these slots in the first ones
    groups = plan.groups(3)
    assert len(groups) == 3 and any(plan.slots[b.slot].param_at_f for b in groups[0])
    assert not run.errors
    assert every_commit_is_the_state_at_f(run, tmp_path) == [5, 9, 13]


def test_the_parameters_copied_at_f_are_copied_by_the_last_group_only(moments_only):
    moments_only(lambda p: p.dim() == 2)
    model, opt = model_and_opt()
    plan = build_plan(model, opt, 64, 3)
    adapters.attach_adapter(plan, opt).close()
    tables, params = plan.group_tables(3), plan.group_param_tables(3)
    late = {si for si, s in enumerate(plan.slots) if s.param_at_f}
    assert late == {si for si, s in enumerate(plan.slots) if s.param.dim() == 2}
    for j in range(2):  # the first groups: no parameter of those slots
        assert not set(params[j].slot.tolist()) & late
        assert set(params[j].slot.tolist()) == set(tables[j].slot.tolist()) - late
    every = {(b.slot, b.start) for b in plan.blocks if b.slot in late}
    assert every <= {(int(s), int(st)) for s, st in zip(params[2].slot, params[2].start)}


def test_without_the_copy_at_f_the_verification_refuses_the_checkpoint(tmp_path, moments_only,
                                                                       monkeypatch):
    """The copy at F is what makes these checkpoints right: with it taken out (the last
    group's parameter table being the group's own), the parameters are stale and the
    verification refuses every replayed checkpoint."""
    moments_only(lambda p: True)
    monkeypatch.setattr(Plan, "group_param_tables", Plan.group_tables)
    with pytest.warns(UserWarning, match="was not committed"):
        run = train(tmp_path, "gockpt-o")
    refused = [h for h in run.handles if h.error is not None]
    assert refused and all("differ" in str(h.error) for h in refused)


def test_metrics_say_what_was_replayed_and_what_copied_at_f(tmp_path, moments_only):
    """metrics.jsonl: the parameters copied at F move their bytes from replayed to copied at
    F; the total is the state either way, and a mode without replay replays nothing."""
    from gockpt import metrics

    def bytes_of(directory):
        rows = metrics.read(str(directory))
        assert [r["final_step"] for r in rows] == [5, 9, 13]
        return [(r["replayed_bytes"], r["copied_at_f_bytes"], r["state_bytes"]) for r in rows]

    full = bytes_of(train(tmp_path / "full", "gockpt-o").ck.config.directory)
    moments_only(lambda p: p.dim() == 2)
    part = bytes_of(train(tmp_path / "part", "gockpt-o").ck.config.directory)
    none = bytes_of(train(tmp_path / "none", "async-o").ck.config.directory)
    model, _ = model_and_opt()
    weights = 4 * sum(p.numel() for p in model.parameters() if p.dim() == 2)
    for (r_full, f_full, total), (r_part, f_part, _), (r_none, f_none, _) in zip(full, part, none):
        assert r_full + f_full == r_part + f_part == total == r_none + f_none
        assert 0 < r_part < r_full and r_none == 0
        # the weights' bytes in the replayed groups now cross at F
        assert f_part - f_full == r_full - r_part <= weights
