"""gockpt.storage.dcp: a gockpt checkpoint read by torch.distributed.checkpoint (one process
here; several ranks and resharding in tests/test_many_ranks.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gockpt
import gockpt.testing
from gockpt import storage
from gockpt.storage.dcp import GockptReader, flat_boxes


@pytest.mark.parametrize("shape,lo,hi", [((3, 4, 5), 7, 53), ((3, 4, 5), 0, 60), ((7,), 2, 5),
                                         ((2, 3), 3, 3), ((4, 1, 3), 1, 11)])
def test_a_flat_run_is_cut_into_boxes_contiguous_in_it(shape, lo, hi):
    whole = torch.arange(math.prod(shape)).view(shape)
    seen = []
    for start, offsets, sizes in flat_boxes(shape, lo, hi):
        box = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        assert torch.equal(box.reshape(-1), torch.arange(start, start + box.numel()))
        seen += box.reshape(-1).tolist()
    assert seen == list(range(lo, hi))
    assert len(flat_boxes(shape, lo, hi)) <= 2 * len(shape)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_dcp_load_through_the_reader_restores_model_and_optimizer_bitwise(tmp_path):
    model, opt = _model()
    ck = gockpt.Checkpointer(model, opt, str(tmp_path), mode="sync")
    for step, x in zip(range(3), itertools.repeat(torch.randn(4, 8))):
        ck.backward_begin()
        model(x).square().mean().backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1, force=True)
    ck.close()
    fresh, fresh_opt = _model()
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optimizer": osd}
    reader = GockptReader(storage.resolve(str(tmp_path)))
    dcp.load(state, storage_reader=reader, no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    why = gockpt.testing.first_difference(gockpt.testing.snapshot(model, opt),
                                          gockpt.testing.snapshot(fresh, fresh_opt))
    assert why is None, why
    assert reader.read_bytes >= 12 * sum(p.numel() for p in model.parameters())
