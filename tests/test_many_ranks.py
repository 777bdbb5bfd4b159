"""Many ranks on this CPU (gloo processes, as torchrun starts them): replicas of one state
(DistributedDataParallel) split every checkpoint into shares -- each rank copies, replays,
stages and writes about 1/N of the state -- and a load puts the shares together, bitwise.
The ranks run tests/_support/ranks_worker.py."""

from __future__ import annotations

import json
import math
import os
import signal
import warnings

import pytest
import torch

import gockpt
from gockpt import storage
from gockpt.cli import main as cli_main
from gockpt.core import metrics
from gockpt.storage.manifest import parse as parse_manifest
from gockpt.storage.schema import is_small_tensor
from tests._support.cli_helpers import flip_byte
from tests._support.dist_ranks import run_ranks, start_ranks
from tests._support.ranks_worker import SAVE_AT, layers, model_and_optimizer

WORKER = "ranks_worker"

CASES = [pytest.param(2, "gockpt-o", id="2-gockpt-o"),
         pytest.param(2, "async-o", id="2-async-o", marks=pytest.mark.slow),
         pytest.param(4, "gockpt-o", id="4-gockpt-o", marks=pytest.mark.slow),
         pytest.param(4, "async-o", id="4-async-o", marks=pytest.mark.slow)]


def _state_bytes() -> int:
    """S: the model's fp32 parameters and AdamW's two moments."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    try:
        ddp, _, _ = model_and_optimizer()
        return 12 * sum(p.numel() for p in ddp.parameters())
    finally:
        torch.distributed.destroy_process_group()


def _parts(path: str):
    """(part directory, its manifest) of every rank's part of checkpoint ``path``."""
    top = storage.read_manifest(path)
    return [(os.path.join(path, p), storage.read_manifest(os.path.join(path, p)))
            for p in top["ranks"]]


@pytest.mark.parametrize("world,mode", CASES)
def test_replicas_write_shares_that_load_and_resume_bitwise(tmp_path, world, mode):
    directory = str(tmp_path / "ddp")
    # in the ranks: training with gockpt == without; each checkpoint loads == live at F
    run_ranks(directory, f"train:{mode}", world=world, worker=WORKER)
    # fresh processes on the same N resume bit for bit like the uninterrupted run
    run_ranks(directory, f"resume:{mode}", world=world, worker=WORKER)

    s = _state_bytes()
    records = metrics.read(directory)
    assert sorted((r["final_step"], r["rank"]) for r in records) == \
        sorted((f, r) for f in SAVE_AT for r in range(world))
    for path in (os.path.join(directory, storage.checkpoint_name(f)) for f in SAVE_AT):
        top = storage.read_manifest(path)
        assert top["shares"] is True and top["replicated"] is True and top["world_size"] == world
        state_written = 0
        for part, m in _parts(path):
            record = next(r for r in records if r["rank"] == m["rank"]
                          and r["final_step"] == m["step"])
            share = sum(math.prod(e["shape"]) * storage.CODE_TO_DTYPE[e["dtype"]].itemsize
                        for n, e in m["tensors"].items() if not is_small_tensor(n))
            small = sum(e["data_offsets"][1] - e["data_offsets"][0] if "data_offsets" in e
                        else math.prod(e["shape"]) * storage.CODE_TO_DTYPE[e["dtype"]].itemsize
                        for n, e in m["tensors"].items() if is_small_tensor(n))
            state_written += share
            # copied (replayed or at F), staged and written: within 10% of S/N
            for what, got in (("copied", record["replayed_bytes"] + record["copied_at_f_bytes"]),
                              ("staged", record["state_bytes"]), ("stored", share)):
                assert abs(got - s / world) <= 0.1 * s / world, (part, what, got, s / world)
            # the data file: the share, the small state and the format's alignment per tensor
            limit = 1.1 * s / world + small + storage.ALIGN * (len(m["tensors"]) + 2)
            assert record["written_bytes"] == os.path.getsize(
                os.path.join(part, storage.DATA_FILE)) <= limit, (part, record["written_bytes"])
        assert state_written == s  # each replicated byte once in the directory


FSDP2_CASES = [pytest.param(2, "gockpt-o", id="2-gockpt-o"),
               pytest.param(2, "async-o", id="2-async-o", marks=pytest.mark.slow),
               pytest.param(4, "gockpt-o", id="4-gockpt-o", marks=pytest.mark.slow),
               pytest.param(4, "async-o", id="4-async-o", marks=pytest.mark.slow)]


@pytest.mark.parametrize("world,mode", FSDP2_CASES)
def test_fsdp2_shards_load_and_resume_bitwise(tmp_path, world, mode, capsys):
    """FSDP2 (fully_shard, a 1-D mesh): DTensor parameters and AdamW state planned, copied,
    replayed and stored through their local shards -- gradients accumulated over two
    micro-batches and clipped over DTensors; on 4 ranks one rank's shards of a 3-row layer
    are empty."""
    directory = str(tmp_path / "fsdp2")
    run_ranks(directory, f"train:{mode}:fsdp2", world=world, worker=WORKER)
    run_ranks(directory, f"resume:{mode}:fsdp2", world=world, worker=WORKER)
    if world == 2:  # sharded by columns on as many ranks: resharded through DCP
        run_ranks(directory, f"resharded:{mode}:fsdp2", world=world, worker=WORKER)
    for path in (os.path.join(directory, storage.checkpoint_name(f)) for f in SAVE_AT):
        top = storage.read_manifest(path)
        assert top["world_size"] == world and not top.get("replicated")
        for part, data in _parts(path):
            # each part holds its rank's row slices of every parameter, as the index says
            m = parse_manifest(part, data)
            for name, ref in m.model.params.items():
                got = [s for s in top["index"][name]["slices"] if s[0] == m.rank]
                assert got == [[m.rank, m.model.slices[name]["offsets"],
                                list(m.logical_shape(ref))]], (name, got)
        # the slices of every tensor cover it once
        for name, entry in top["index"].items():
            rows = sorted((s[1][0], s[1][0] + s[2][0]) for s in entry["slices"])
            assert rows[0][0] == 0 and rows[-1][1] == entry["shape"][0], (name, rows)
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), (name, rows)
        assert gockpt.verify(path).ok
    # inspect shows the sharding; export refuses one rank's shards as a model (every rank's
    # put together: test_export_of_a_sharded_checkpoint_...)
    capsys.readouterr()
    assert cli_main(["inspect", directory]) == 0
    assert "layout       sharded (DTensor" in capsys.readouterr().out
    assert cli_main(["export", directory, "--to", "safetensors", "--rank", "1",
                     str(tmp_path / "model.safetensors")]) == 2
    assert "--rank does not apply" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "model.safetensors")
    # an index that misplaces a slice is found by verify
    from gockpt.storage.format import seal_manifest
    top = storage.read_manifest(path)
    top["index"]["0.weight"]["slices"][0][1][0] += 1
    with open(os.path.join(path, storage.MANIFEST_FILE), "wb") as f:
        f.write(seal_manifest({k: v for k, v in top.items() if k != "manifest_crc32c"}))
    report = gockpt.verify(path)
    assert not report.ok and "'0.weight'" in str(report), report


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gockpt-o", "async-o"])
def test_hsdp_replicas_split_each_shard_into_shares_that_load_and_resume_bitwise(tmp_path, mode):
    """HSDP (FSDP2 on a 2-D mesh: two replicas of the model, each sharded over two ranks):
    the two ranks holding a shard alike (a Replicate() mesh dimension) split it, with its
    AdamW state, into shares -- each rank stores about a quarter of the state, each element
    of each tensor once in the directory -- and a load puts each rank's shard together from
    its replica's part and its own, bitwise; a resume continues bit for bit."""
    directory = str(tmp_path / "hsdp")
    run_ranks(directory, f"train:{mode}:hsdp", world=4, worker=WORKER)
    run_ranks(directory, f"resume:{mode}:hsdp", world=4, worker=WORKER)
    s = 12 * sum(p.numel() for p in layers("hsdp").parameters())
    for path in (os.path.join(directory, storage.checkpoint_name(f)) for f in SAVE_AT):
        top = storage.read_manifest(path)
        assert top["shares"] is True and not top.get("replicated")
        for name, entry in top["index"].items():
            blocks, held = {}, 0
            for rank, offsets, lengths, *extent in entry["slices"]:
                blocks.setdefault(tuple(offsets), set()).add(rank)
                held += (extent[0][1] - extent[0][0]) if extent else math.prod(lengths)
            # mesh [[0, 1], [2, 3]]: ranks r and r + 2 hold the same shard, and write it once
            assert all(ranks <= {0, 2} or ranks <= {1, 3} for ranks in blocks.values())
            assert held == math.prod(entry["shape"]), (name, entry["slices"])
        for part, m in _parts(path):
            stored = sum(math.prod(e["shape"]) * storage.CODE_TO_DTYPE[e["dtype"]].itemsize
                         for n, e in m["tensors"].items() if not is_small_tensor(n))
            assert abs(stored - s / 4) <= 0.1 * s / 4, (part, stored, s / 4)
        assert gockpt.verify(path).ok


@pytest.mark.parametrize("world,mode", [pytest.param(2, "gockpt-o", id="2-gockpt-o"),
                                        pytest.param(4, "async-o", id="4-async-o",
                                                     marks=pytest.mark.slow)])
def test_replicated_weights_in_shares_beside_each_ranks_own_partition(tmp_path, world, mode,
                                                                     capsys):
    """ZeRO-1's state (tests/_support/ranks_worker.py: ZeroLike): the weights every rank holds
    are written once, in shares; each rank's fp32 partition and its AdamW state are its own
    slice of one global tensor (Config.replicated names the weights, global_slices the
    partition). Training with gockpt is bitwise training without; every checkpoint loads ==
    live at F; a resume continues bit for bit."""
    directory = str(tmp_path / "zero")
    run_ranks(directory, f"train:{mode}:zero", world=world, worker=WORKER)
    run_ranks(directory, f"resume:{mode}:zero", world=world, worker=WORKER)
    path = storage.resolve(directory)
    top = storage.read_manifest(path)
    assert top["shares"] is True and not top.get("replicated")
    index, held = top["index"], {}
    assert [s[0] for s in index["master"]["slices"]] == list(range(world))
    assert all("shares" in e for n, e in index.items() if n != "master")
    for part, data in _parts(path):
        m = parse_manifest(part, data)
        assert set(m.model.slices) == {"master"} and m.optimizer.params == {0: "master"}
        for name, ref in m.model.params.items():
            n = ref.extent[1] - ref.extent[0] if ref.extent else math.prod(m.logical_shape(ref))
            held[name] = held.get(name, 0) + n
    # each element of each tensor once in the directory: replicated or partitioned
    assert held == {name: math.prod(e["shape"]) for name, e in index.items()}
    assert gockpt.verify(path).ok
    capsys.readouterr()
    assert cli_main(["inspect", directory]) == 0
    out = capsys.readouterr().out
    assert f"replicas of a shard) in {world} shares" in out and "sharded (DTensor shards" in out
    assert "master: global shape" in out


@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow),
                                  pytest.param("zero", marks=pytest.mark.slow),
                                  pytest.param("hsdp", marks=pytest.mark.slow)])
def test_a_rank_killed_while_writing_its_part_leaves_the_previous_latest(tmp_path, kind):
    directory = str(tmp_path / kind)
    world = 4 if kind == "hsdp" else 2
    procs = start_ranks(directory, f"kill:gockpt-o:{kind}", world, WORKER)
    out1, err1 = procs[1].communicate(timeout=240)
    assert procs[1].returncode == -signal.SIGKILL, (out1, err1)
    assert "rank 1: killed in the write" in out1
    for rank, proc in enumerate(procs):
        if rank != 1:
            proc.kill()  # as torchrun stops the job when one of its ranks dies
            out, _ = proc.communicate(timeout=60)
            assert f"rank {rank}: ok" not in out

    first, second = (storage.checkpoint_name(s) for s in SAVE_AT)
    assert os.path.basename(storage.resolve(directory)) == first
    assert storage.list_checkpoints(directory) == [first]
    assert not os.path.exists(os.path.join(directory, second))
    assert gockpt.verify(directory).ok
    # a restart loads it and clears the leftovers (DDP here on one rank: its state is
    # replicated; FSDP2's, HSDP's and ZeRO's per-rank shards on as many ranks)
    if kind != "ddp":
        run_ranks(directory, f"reload:gockpt-o:{kind}", world=world, worker=WORKER)
    else:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
        try:
            ddp, opt, sched = model_and_optimizer()
            assert gockpt.load(directory, ddp, opt, scheduler=sched).step == SAVE_AT[0]
            gockpt.Checkpointer(ddp, opt, directory, mode="gockpt-o").close()
        finally:
            torch.distributed.destroy_process_group()
    assert not [n for n in os.listdir(directory) if n.startswith(storage.TMP_PREFIX)]


@pytest.mark.parametrize("kind", ["ddp", pytest.param("hsdp", marks=pytest.mark.slow)])
def test_replicas_that_plan_otherwise_are_refused_on_every_rank(tmp_path, kind):
    """One replica cuts its blocks otherwise (DDP: rank 0 of 2; HSDP: rank 2, the replica of
    rank 0's shard): every rank raises the ConfigError -- those whose replicas agree too,
    none is left waiting in a collective."""
    run_ranks(str(tmp_path / kind), f"mismatch:gockpt-o:{kind}",
              world=4 if kind == "hsdp" else 2, worker=WORKER)


def test_inspect_shows_the_shares_and_verify_checks_their_cover(tmp_path, capsys):
    directory = str(tmp_path / "ddp")
    run_ranks(directory, "train:gockpt-o", world=2, worker=WORKER)
    path = storage.resolve(directory)
    report = gockpt.verify(path)
    assert report.ok, report
    # gockpt inspect shows the parallel layout
    assert cli_main(["inspect", directory]) == 0
    shown = capsys.readouterr().out
    assert "layout       one replicated state in 2 shares" in shown
    assert cli_main(["inspect", directory, "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["shares"] and layout["replicated"] and layout["world_size"] == 2
    assert layout["split"] and set(layout["split"].values()) == {2}
    assert cli_main(["inspect", directory, "--rank", "1"]) == 0
    assert "(a share)" in capsys.readouterr().out
    # gockpt export puts the shares together: the model gockpt.load restores
    out = str(tmp_path / "model.safetensors")
    assert cli_main(["export", directory, "--to", "safetensors", out]) == 0
    assert "every rank's share, put together" in capsys.readouterr().out
    from safetensors.torch import load_file
    exported = load_file(out)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    try:
        ddp, opt, sched = model_and_optimizer()
        gockpt.load(directory, ddp, opt, scheduler=sched)
    finally:
        torch.distributed.destroy_process_group()
    loaded = ddp.module.state_dict()
    assert exported.keys() == loaded.keys()
    assert all(torch.equal(exported[n], loaded[n]) for n in loaded)
    # a tied alias is recorded in every share, its parameter in one of them: verify takes it
    # (it reported the share without the parameter); an alias of nothing is reported
    from gockpt.storage.format import seal_manifest
    parts = _parts(path)
    alone = next(n for n in parts[0][1]["model"]["params"]
                 if n not in parts[1][1]["model"]["params"])
    for target, problems in ((alone, 0), ("nowhere.weight", 1)):
        for part, m in parts:
            m["model"]["aliases"] = {"tied.weight": target}
            with open(os.path.join(part, storage.MANIFEST_FILE), "wb") as f:
                f.write(seal_manifest({k: v for k, v in m.items() if k != "manifest_crc32c"}))
        report = gockpt.verify(path).checkpoints[0]
        assert len(report.problems) == problems and report.ok == (problems == 0), report
    for part, m in parts:
        m["model"]["aliases"] = {}
        with open(os.path.join(part, storage.MANIFEST_FILE), "wb") as f:
            f.write(seal_manifest({k: v for k, v in m.items() if k != "manifest_crc32c"}))
    assert gockpt.verify(path).ok
    # a part's manifest that lost its share of a tensor is found by verify and by load
    part, m = parts[1]
    name, ref = next((n, r) for n, r in m["model"]["params"].items() if isinstance(r, dict)
                     and "extent" in r)
    del m["model"]["params"][name]
    m["model"]["digests"].pop(name, None)
    m["optimizer"]["params"] = {i: n for i, n in m["optimizer"]["params"].items() if n != name}
    with open(os.path.join(part, storage.MANIFEST_FILE), "wb") as f:
        f.write(seal_manifest({k: v for k, v in m.items() if k != "manifest_crc32c"}))
    assert not gockpt.verify(path).ok
    from gockpt.storage.dcp import GockptReader  # DCP's metadata has the gap too
    with pytest.raises(gockpt.CorruptCheckpointError, match=f"slices of .{name}. do not cover"):
        GockptReader(path).read_metadata()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    try:
        ddp, opt, sched = model_and_optimizer()
        with pytest.raises(gockpt.CorruptCheckpointError, match=f"parameter '{name}'.*nowhere"):
            gockpt.load(directory, ddp, opt, scheduler=sched, tag=os.path.basename(path))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("saved,loaded", [pytest.param(2, 4, id="2-to-4"),
                                          pytest.param(4, 2, id="4-to-2", marks=pytest.mark.slow),
                                          pytest.param(2, 1, id="2-to-1", marks=pytest.mark.slow)])
def test_dcp_loads_an_fsdp2_checkpoint_on_another_number_of_ranks(tmp_path, saved, loaded):
    """torch.distributed.checkpoint.load with gockpt's StorageReader (its metadata from the
    manifests and the global index, DCP's own planner): an FSDP2 checkpoint of ``saved``
    ranks into FSDP2 on ``loaded`` ranks equals the state the saving run gathered at F, bit
    for bit; training goes on. Each rank reads about 1/``loaded`` of the stored bytes (byte
    ranges of the stored tensors, in whole 8 KiB checksum chunks)."""
    import re
    directory = str(tmp_path / "fsdp2")
    run_ranks(directory, "train:gockpt-o:fsdp2", world=saved, worker=WORKER)
    outs = run_ranks(directory, "dcp:gockpt-o:fsdp2", world=loaded, worker=WORKER)
    read = [int(re.search(r"read (\d+) bytes", out).group(1)) for out, _ in outs]
    path = storage.resolve(directory)
    stored = sum(math.prod(e["shape"]) * storage.CODE_TO_DTYPE[e["dtype"]].itemsize
                 for _, m in _parts(path) for n, e in m["tensors"].items()
                 if not is_small_tensor(n))
    print(f"{saved} -> {loaded} ranks: read {read} of {stored} stored bytes")
    assert sum(read) >= stored  # every stored parameter and moment was read
    assert all(abs(r - stored / loaded) <= 0.2 * stored / loaded for r in read), (read, stored)
    if saved % loaded == 0:  # a loading rank's block holds whole stored blocks: read once
        assert sum(read) == stored, (read, stored)


def test_a_flipped_byte_is_reported_through_dcp(tmp_path):
    directory = str(tmp_path / "fsdp2")
    run_ranks(directory, "train:gockpt-o:fsdp2", world=2, worker=WORKER)
    path = storage.resolve(directory)
    part, m = _parts(path)[1]
    name = next(n for n in m["tensors"] if n.startswith("model/"))
    flip_byte(part, name)
    procs = start_ranks(directory, "dcp:gockpt-o:fsdp2", 2, WORKER)
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert any("crc32c" in out + err and name in out + err for out, err in outs), outs


@pytest.mark.parametrize("kind,saved,loads", [
    pytest.param("ddp", 2, ["ddp:1", "ddp:4", "fsdp2:2"], id="ddp-2", marks=pytest.mark.slow),
    pytest.param("ddp", 1, ["ddp:2"], id="ddp-1", marks=pytest.mark.slow),
    pytest.param("ddp", 4, ["ddp:2"], id="ddp-4", marks=pytest.mark.slow),
    pytest.param("fsdp2", 2, ["fsdp2:1", "fsdp2:4", "ddp:2"], id="fsdp2-2"),
    pytest.param("fsdp2", 1, ["fsdp2:2"], id="fsdp2-1", marks=pytest.mark.slow),
    pytest.param("fsdp2", 4, ["fsdp2:2"], id="fsdp2-4", marks=pytest.mark.slow)])
def test_gockpt_load_resumes_on_another_number_of_ranks_and_parallelism(tmp_path, kind, saved,
                                                                        loads):
    """A checkpoint of ``kind`` on ``saved`` ranks loaded with gockpt.load into each of
    ``loads`` (kind:ranks): every tensor of the model and the optimizer equals the state the
    saving run gathered at F, bit for bit; the scheduler follows; RNG states come back only
    on as many ranks (a warning says so otherwise); training goes on. FSDP2 targets are
    loaded through DCP's planner (resharded), DDP on any number of ranks from the shares."""
    directory = str(tmp_path / kind)
    run_ranks(directory, f"train:gockpt-o:{kind}", world=saved, worker=WORKER)
    for load in loads:
        target, world = load.split(":")
        outs = run_ranks(directory, f"reshard:gockpt-o:{target}:{kind}", world=int(world),
                         worker=WORKER)
        layout_changed = target == "fsdp2" or kind == "fsdp2"
        assert all(f"resharded={layout_changed and (target, int(world)) != (kind, saved)}"
                   in out for out, _ in outs), (load, outs)
    # here, one process without torch.distributed: a plain model takes the whole tensors
    plain = layers(kind)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = gockpt.load(directory, plain, opt)
    rng = [w for w in caught if "RNG states are per rank" in str(w.message)]
    assert len(rng) == (saved > 1) and all(w.filename == __file__ for w in rng), rng
    assert restored.resharded == (kind == "fsdp2" and saved > 1)
    saved_state = torch.load(f"{directory}.global.pt", weights_only=True)
    names = [n for n, _ in plain.named_parameters()]
    got = {"model": plain.state_dict(),
           "optimizer": {names[i]: st for i, st in opt.state_dict()["state"].items()}}
    why = gockpt.testing.first_difference({k: saved_state[k] for k in got}, got, "one process")
    assert why is None, why


def test_what_cannot_be_resharded_is_refused_naming_the_tensor_before_any_change(tmp_path):
    """An FSDP2 checkpoint of 2 ranks loaded in one process into models it does not fit: a
    parameter on one side only, another shape, another dtype, an optimizer that steps other
    parameters -- a LoadError naming the tensor, the model and the optimizer untouched; a
    flipped byte is the checksum error naming it."""
    directory = str(tmp_path / "fsdp2")
    run_ranks(directory, "train:gockpt-o:fsdp2", world=2, worker=WORKER)

    def refused(model, opt, match):
        before = gockpt.testing.snapshot(model, opt)
        with pytest.raises(gockpt.LoadError, match=match):
            gockpt.load(directory, model, opt, restore_rng=False)
        why = gockpt.testing.first_difference(before, gockpt.testing.snapshot(model, opt))
        assert why is None, why

    fewer = layers("ddp")  # without the last layer
    refused(fewer, torch.optim.AdamW(fewer.parameters()), r"parameter '6\.(weight|bias)' that "
            "the model does not have")
    more = layers("fsdp2").append(torch.nn.Linear(3, 2))
    refused(more, torch.optim.AdamW(more.parameters()), r"'7\.weight' is not in the checkpoint")
    wider = layers("fsdp2")
    wider[6] = torch.nn.Linear(64, 5)
    refused(wider, torch.optim.AdamW(wider.parameters()), r"parameter '6\.weight' has shape "
            r"\[3, 64\] in the checkpoint but \[5, 64\]")
    half = layers("fsdp2").to(torch.float64)
    refused(half, torch.optim.AdamW(half.parameters()), r"'0\.weight' is torch\.float32 in the "
            "checkpoint but torch.float64")
    model = layers("fsdp2")
    refused(model, torch.optim.AdamW(list(model.parameters())[:-2]),
            r"optimizer state of '6\.(weight|bias)', which the optimizer does not step")
    # a damaged byte met while reading: the checksum error itself, naming file and tensor
    part, m = _parts(storage.resolve(directory))[1]
    name = next(n for n in m["tensors"] if n.startswith("model/"))
    flip_byte(part, name)
    with pytest.raises(gockpt.CorruptCheckpointError,
                       match=rf"'{name}'.*checksum mismatch.*partly overwritten"):
        gockpt.load(directory, model, torch.optim.AdamW(model.parameters()), restore_rng=False)


def test_export_of_a_sharded_checkpoint_writes_whole_tensors_reading_each_slice_once(tmp_path,
                                                                                      capsys):
    """``gockpt export --to safetensors`` of an FSDP2 checkpoint of 2 ranks: the model's whole
    tensors, equal to the state gathered at F, each stored slice read once; with
    ``--shard-size``, Hugging Face's layout: files of at most that size and their index."""
    from safetensors.torch import load_file
    directory = str(tmp_path / "fsdp2")
    run_ranks(directory, "train:gockpt-o:fsdp2", world=2, worker=WORKER)
    saved = torch.load(f"{directory}.global.pt", weights_only=True)["model"]
    out = str(tmp_path / "model.safetensors")
    assert cli_main(["export", directory, "--to", "safetensors", out]) == 0
    printed = capsys.readouterr().out
    got = load_file(out)
    assert got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) for n in saved)
    path = storage.resolve(directory)
    stored = {(part, ref.tensor): m.tensors[ref.tensor]["nbytes"]
              for part, data in _parts(path) for m in [parse_manifest(part, data)]
              for ref in m.model.params.values()}
    assert f"{sum(stored.values())} bytes read" in printed, (printed, stored)
    index = str(tmp_path / "sharded" / "model.safetensors.index.json")
    os.mkdir(os.path.dirname(index))
    assert cli_main(["export", directory, "--to", "safetensors", index,
                     "--shard-size", "100000"]) == 0
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 1 and weight_map.keys() == saved.keys()
    for name in files:
        shard = load_file(os.path.join(os.path.dirname(index), name))
        assert all(torch.equal(shard[n], saved[n]) and weight_map[n] == name for n in shard)
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= 100000 \
            or len(shard) == 1


@pytest.mark.slow
def test_per_rank_state_that_is_no_slice_is_refused_on_another_number_of_ranks(tmp_path):
    """DDP with ``replicated=False`` on 2 ranks: each part holds the rank's state as its own,
    no slice of a global tensor -- it loads only on 2 ranks: on one, gockpt.load and the DCP
    reader refuse it with a LoadError saying so, the model untouched."""
    directory = str(tmp_path / "own")
    run_ranks(directory, "train:gockpt-o:own", world=2, worker=WORKER)
    from gockpt.storage.dcp import GockptReader
    with pytest.raises(gockpt.LoadError, match="as its own state, no slice of a global tensor"):
        GockptReader(storage.resolve(directory)).read_metadata()
    model = layers("ddp")
    opt = torch.optim.AdamW(model.parameters())
    before = gockpt.testing.snapshot(model, opt)
    with pytest.raises(gockpt.LoadError, match="written by 2 ranks and holds per-rank state"):
        gockpt.load(directory, model, opt)
    assert gockpt.testing.first_difference(before, gockpt.testing.snapshot(model, opt)) is None
