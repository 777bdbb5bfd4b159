"""On a CUDA GPU: every mode's checkpoint is bitwise the live state at F, a killed run resumes
bitwise, training with gockpt is bitwise training without it, and the probe refuses an
optimizer whose arithmetic differs. Skipped where torch.cuda.is_available() is false."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.testing import first_difference, snapshot

from tests._support import gpu_common as G, worker_command, worker_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on a GPU machine)")

MODES = [("sync", 1), ("async", 1), ("async-o", 1)] + \
    [(m, k) for m in ("gockpt", "gockpt-o") for k in (1, 2, 4)]


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("mode,k", MODES)
def test_checkpoint_is_the_live_state_at_f(tmp_path, mode, k, impl):
    model, opt, sched = G.build(impl)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode=mode, overlap_steps=k,
                             scheduler=sched, block_bytes=4096)
    at_f, handles = {}, []

    def on_boundary(step, h):
        if h is not None:
            handles.append(h)
        if any(step == x.final_step for x in handles):
            at_f[step] = snapshot(model, opt, sched)

    G.train(model, opt, sched, 0, 14, ck, force={3, 8}, on_boundary=on_boundary)
    ck.close()
    assert [h.error for h in handles] == [None, None]
    for h in handles:
        fresh, fresh_opt, fresh_sched = G.build(impl, seed=1)
        gockpt.load(str(tmp_path), fresh, fresh_opt, scheduler=fresh_sched,
                    tag=storage.checkpoint_name(h.final_step))
        got = snapshot(fresh, fresh_opt, fresh_sched)
        why = first_difference(at_f[h.final_step]["model"], got["model"])
        why = why or first_difference(at_f[h.final_step]["optimizer"], got["optimizer"])
        assert why is None, (h.final_step, why)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_training_with_gockpt_o_is_training_without_it(tmp_path, impl):
    model, opt, sched = G.build(impl)
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o", overlap_steps=4,
                             scheduler=sched, interval=3)
    with_ck = G.train(model, opt, sched, 0, 16, ck)
    ck.close()
    model2, opt2, sched2 = G.build(impl)
    without = G.train(model2, opt2, sched2, 0, 16)
    assert with_ck == without
    assert first_difference(snapshot(model, opt)["model"], snapshot(model2, opt2)["model"]) \
        is None


WORKER = "gpu_resume_worker"  # a module of tests._support


def run(*args):
    return subprocess.run(worker_command(WORKER, *args), capture_output=True,
                          text=True, timeout=600, env=worker_env())


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_killed_run_resumes_bit_for_bit(tmp_path, impl):
    ref = run("reference", tmp_path, impl, 24, 0)
    assert ref.returncode == 0, ref.stderr
    reference = json.loads(ref.stdout.splitlines()[-1])
    killed = run("train", tmp_path, impl, 24, 17)
    assert killed.returncode == -9, killed.stderr
    resumed = run("resume", tmp_path, impl, 24, 0)
    assert resumed.returncode == 0, resumed.stderr
    out = json.loads(resumed.stdout.splitlines()[-1])
    assert 4 <= out["start"] < 17
    assert out["losses"] == reference["losses"][out["start"]:]
    assert out["digest"] == reference["digest"]


def test_the_probe_on_the_gpu_refuses_an_optimizer_whose_arithmetic_differs(tmp_path,
                                                                          monkeypatch):
    from gockpt.replay import probe
    monkeypatch.setattr(probe, "_PROBED", {})
    real = torch.optim.AdamW.step

    def perturbed(self, *a, **k):
        out = real(self, *a, **k)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    p.view(-1)[0] += 1e-3  # not the arithmetic the replay reproduces
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", perturbed)
    model, opt, _ = G.build("fused")
    with pytest.raises(gockpt.UnsupportedOptimizerError, match="probe replay.*differs"):
        gockpt.Checkpointer(model, opt, str(tmp_path), mode="gockpt-o")
    gockpt.Checkpointer(model, opt, str(tmp_path), mode="async-o").close()  # no replay: fine
