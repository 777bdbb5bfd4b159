"""Helpers shared by the tests of the `gockpt` console tool (tests/cli/)."""

import os

import torch

import gockpt
from gockpt import storage
from gockpt.cli import main


def make_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters())


def train(directory, model, opt, steps=8, inputs=16, mode="gockpt-o", overlap_steps=2,
          at=(4, 7)):
    """Train ``steps`` steps on random inputs, checkpoints at the steps ``at``."""
    ck = gockpt.Checkpointer(model, opt, str(directory), mode=mode, overlap_steps=overlap_steps)
    for step in at:
        ck.plan_checkpoint(step)
    for step in range(steps):
        loss = model(torch.randn(8, inputs)).pow(2).mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)
    ck.close()


def flip_byte(ckpt, tensor):
    """Flip one bit in the middle of ``tensor``'s bytes, found through the manifest."""
    e = storage.read_manifest(ckpt)["tensors"][tensor]
    with open(os.path.join(ckpt, e["file"]), "r+b") as f:
        f.seek(e["offset"] + e["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def part_dir(run, rank):
    return os.path.join(run, "step-000000004", f"rank-{rank:05d}")


def _part_model(part):
    """The model state of a part, read with gockpt.storage (name -> tensor)."""
    from gockpt.storage import tree
    manifest = storage.read_manifest(part)
    tensors = storage.read_tensors(part, manifest)
    sd = {name: tensors[t] for name, t in manifest["model"]["params"].items()}
    sd.update(tree.decode(manifest["small"]["model"], tensors))
    return sd
