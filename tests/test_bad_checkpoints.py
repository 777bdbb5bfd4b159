"""Manifests, pointers and files that must never load silently wrong: each class of damage an
adversarial check found, as a test (the random search over them is tests/test_fuzz_load.py).

Two kinds of change are made: *damage* (bytes flipped, files cut or replaced: what storage
does) and *rewrites* (a manifest edited and sealed again: what a buggy writer, or a person,
produces). Damage must be named as such; a rewrite that makes the checkpoint say something
impossible must be refused before anything of the model or optimizer is touched."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

import gockpt
from gockpt import storage
from gockpt.storage.commit import read_latest

from tests._support import harness as H
from tests._support.manifests import read_raw, rewrite, write_sealed, write_sealed_text


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Checkpoints of steps 3 and 6 (gockpt-o, K=2) of the harness model, and the state of
    each as a fresh model loads it."""
    root = tmp_path_factory.mktemp("bad") / "run"
    H.seed_all(0)
    model, opt, sched = H.build()
    ck = gockpt.Checkpointer(model, opt, str(root), mode="gockpt-o", overlap_steps=2,
                             scheduler=sched, block_bytes=4096, interval=3)
    H.train_steps(model, opt, sched, 0, 6, ck)
    ck.close()
    states = {}
    for step in (3, 6):
        m, o, s = fresh()
        gockpt.load(str(root), m, o, scheduler=s, tag=storage.checkpoint_name(step))
        states[step] = H.snapshot(m, o, s)
    return root, states


@pytest.fixture
def run(template, tmp_path):
    root, _ = template
    shutil.copytree(root, tmp_path / "run")
    return tmp_path / "run"


def fresh():
    return H.build(seed=123)


def step_dir(run, step=6):
    return run / storage.checkpoint_name(step)


def load_untouched(run, match, **kw):
    """gockpt.load raises a gockpt error matching ``match`` and leaves the targets as they
    were (nothing read into them before the damage was found)."""
    m, o, s = fresh()
    before = H.snapshot(m, o, s)
    with pytest.raises(gockpt.GockptError, match=match):
        gockpt.load(str(run), m, o, scheduler=s, **kw)
    H.assert_same(before, H.snapshot(m, o, s))


def first_state_index(data) -> str:
    return min(data["optimizer"]["aligned"], key=int)


# ------------------------------------------------------------------ silently wrong before

def test_a_flipped_byte_that_keeps_the_manifest_valid_json_is_named(run):
    path = step_dir(run) / storage.MANIFEST_FILE
    raw = path.read_bytes()
    i = raw.index(b'"lr":')
    i = next(j for j in range(i, len(raw)) if raw[j:j + 1] in b"23456789")  # an lr digit
    flipped = raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:]
    json.loads(flipped)  # still valid JSON, another learning rate
    path.write_bytes(flipped)
    load_untouched(run, r"manifest.json: damaged: its bytes do not match its seal",
                   tag=storage.checkpoint_name(6))
    report = gockpt.verify(str(step_dir(run)))
    assert not report.ok and "damaged" in report.checkpoints[0].problems[0]


def test_a_damaged_manifest_of_the_latest_is_named_not_blamed_on_the_pointer(run, capsys):
    """The damage is the manifest's: no warning that ``latest`` does not match it first, and
    ``gockpt list`` does not call the pointer missing or stale."""
    import warnings
    from gockpt.cli import main as gockpt_cli
    path = step_dir(run) / storage.MANIFEST_FILE
    raw = path.read_bytes()
    i = raw.index(b'"lr":') + 6
    path.write_bytes(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        load_untouched(run, r"step-000000006.*manifest.json: damaged: its bytes do not match "
                       "its seal")
    gockpt_cli(["list", str(run)])
    assert "missing or stale" not in capsys.readouterr().out


def test_latest_flipped_to_name_another_checkpoint_is_not_followed(run, template):
    _, states = template
    name, seal = read_latest(str(run))
    assert name == storage.checkpoint_name(6)
    # one bit: step-000000006 -> step-000000003, the seal left as it was
    (run / "latest").write_text(f"{storage.checkpoint_name(3)}\n{seal}\n")
    m, o, s = fresh()
    with pytest.warns(RuntimeWarning, match="does not match its manifest"):
        restored = gockpt.load(str(run), m, o, scheduler=s)
    assert restored.step == 6  # the newest committed, whose manifest is intact
    H.assert_same(states[6], H.snapshot(m, o, s))


@pytest.mark.parametrize("change,match", [
    (lambda e: e.update(dtype="I32"), r"is I32, its parameter .* is torch.float32"),
    (lambda e: e.update(shape=[e["shape"][0] * e["shape"][1]]), r"has shape \[\d+\], its parameter"),
])
def test_an_optimizer_state_of_another_dtype_or_shape_is_refused(run, change, match):
    def edit(data):
        idx = first_state_index(data)
        ref = data["optimizer"]["aligned"][idx]["exp_avg"]
        change(data["tensors"][ref if isinstance(ref, str) else ref["tensor"]])
    rewrite(step_dir(run), edit)
    load_untouched(run, match)


def test_a_transposed_optimizer_state_is_refused(run):
    # dims turn the stored bytes into their transpose: the digest of the logical tensor differs
    def edit(data):
        for idx, by_key in data["optimizer"]["aligned"].items():
            tensor = by_key["exp_avg"]
            if isinstance(tensor, str) and len(data["tensors"][tensor]["shape"]) == 2:
                rows, cols = data["tensors"][tensor]["shape"]
                if rows == cols:  # a square weight: the same shape either way
                    by_key["exp_avg"] = {"tensor": tensor, "dims": [1, 0]}
                    return
        raise AssertionError("the harness model has a square weight")
    rewrite(step_dir(run), edit)
    m, o, s = fresh()
    with pytest.raises(gockpt.CorruptCheckpointError,
                       match=r"optimizer state \[\d+\]\['exp_avg'\] .*do not hold the training"):
        gockpt.load(str(run), m, o, scheduler=s)


def test_a_missing_optimizer_section_is_refused(run):
    rewrite(step_dir(run), lambda data: data.pop("optimizer"))
    load_untouched(run, r"optimizer state \[\d+\] has \['step'\] but not \['exp_avg', "
                        r"'exp_avg_sq'\]: the checkpoint lost its moments")


@pytest.mark.parametrize("how,match", [
    ("swap", r"refers to tensor 'optim/\d+/exp_avg_sq'; it is stored as 'optim/\d+/exp_avg'"),
    ("duplicate", r"refers to tensor 'optim/\d+/exp_avg'; it is stored as 'optim/\d+/exp_avg_sq'"),
    ("self", r"refers to tensor 'model/.*'; it is stored as 'optim/"),
    ("rename", r"refers to tensor 'optim/\d+/exp_avg', which is not stored"),
    ("unknown index", r"optimizer state \[\d+\] belongs to no parameter"),
])
def test_optimizer_state_references_are_total_unique_and_of_their_role(run, how, match):
    def edit(data):
        aligned = data["optimizer"]["aligned"]
        idx = first_state_index(data)
        refs = aligned[idx]
        if how == "swap":
            refs["exp_avg"], refs["exp_avg_sq"] = refs["exp_avg_sq"], refs["exp_avg"]
        elif how == "duplicate":
            refs["exp_avg_sq"] = refs["exp_avg"]
        elif how == "self":
            refs["exp_avg"] = next(r for r in data["model"]["params"].values()
                                   if isinstance(r, str))
        elif how == "rename":
            tensor = refs["exp_avg"]
            data["tensors"][tensor + "-x"] = data["tensors"].pop(tensor)
        else:  # consistently renamed: a state of an index the optimizer does not have
            new = str(10 ** 6)
            aligned[new] = {k: f"optim/{new}/{k}" for k in aligned.pop(idx)}
            for k, tensor in refs.items():
                data["tensors"][f"optim/{new}/{k}"] = data["tensors"].pop(tensor)
            d = data["optimizer"].get("digests", {})
            if idx in d:
                d[new] = d.pop(idx)
        if how in ("swap", "duplicate", "self", "rename"):
            data["optimizer"].get("digests", {}).pop(idx, None)
    rewrite(step_dir(run), edit)
    load_untouched(run, match)


def test_parameter_references_shared_or_renamed_are_refused(run):
    def edit(data):
        params = data["model"]["params"]
        a, b = [n for n, r in params.items() if isinstance(r, str)][:2]
        params[b] = params[a]
    rewrite(step_dir(run), edit)
    load_untouched(run, r"parameter .* refers to tensor 'model/.*'; it is stored as")


# ------------------------------------------------------------------ exceptions not gockpt's

def test_a_name_the_file_system_cannot_take_is_a_gockpt_error(run):
    m, o, s = fresh()
    with pytest.raises(gockpt.CheckpointNotFoundError, match="invalid checkpoint tag"):
        gockpt.load(str(run), m, o, tag="step-\udcff")
    (run / "latest").write_bytes(b"step-\xed\xb3\xbf\n")  # a lone surrogate, as UTF-8 would
    with pytest.warns(RuntimeWarning, match="latest.* is damaged"):
        gockpt.load(str(run), m, o, scheduler=s)


def test_json_nested_too_deeply_is_a_gockpt_error(run):
    path = step_dir(run)
    data = read_raw(path)
    data.pop("manifest_crc32c")
    data["small"]["extra_state"] = "PLACEHOLDER"
    # beyond what json parses
    write_sealed_text(path, json.dumps(data).replace('"PLACEHOLDER"',
                                                     "[" * 100_000 + "0" + "]" * 100_000))
    load_untouched(run, r"manifest.json: nested too deeply", tag=storage.checkpoint_name(6))
    # deep, but within what json parses: the state decoder refuses it
    data["small"]["extra_state"] = json.loads("[" * 900 + "]" * 900)
    write_sealed(path, data)
    load_untouched(run, r"nested deeper than 100 levels", tag=storage.checkpoint_name(6))


@pytest.mark.parametrize("bad", ["00", "", "zz"])
def test_a_malformed_numpy_scalar_is_a_gockpt_error(run, bad):
    def edit(data):
        data["small"]["extra_state"] = {"__t": "np", "dtype": "<f8", "hex": bad}
    rewrite(step_dir(run), edit)
    load_untouched(run, r"small state does not decode|malformed 'np' value")


def test_a_malformed_step_column_is_a_gockpt_error(run):
    def edit(data):
        columns = data["small"]["optimizer"]["columns"]
        key = next(iter(columns))
        columns[key][0]["index"] = columns[key][0]["index"] + [10 ** 9]
    rewrite(step_dir(run), edit)
    load_untouched(run, r"manifest.json: the small state does not decode")


def test_latest_linked_to_an_endless_file_is_a_gockpt_error(run, template):
    _, states = template
    (run / "latest").unlink()
    os.symlink("/dev/zero", run / "latest")
    m, o, s = fresh()
    with pytest.warns(RuntimeWarning, match="latest.* is damaged .*not a regular file"):
        gockpt.load(str(run), m, o, scheduler=s)
    H.assert_same(states[6], H.snapshot(m, o, s))
    big = run / "big"
    big.write_bytes(b"x" * 5000)
    (run / "latest").unlink()
    os.symlink(big, run / "latest")
    with pytest.warns(RuntimeWarning, match="latest.* is damaged .*more than the 4096"):
        gockpt.load(str(run), m, o, scheduler=s)


# ------------------------------------------------------------------ hangs

def finishes(fn, seconds=30.0):
    """Runs ``fn`` on a thread; the exception it raised, or AssertionError if it hangs."""
    out = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "hung"
    return out.get("exc")


@pytest.mark.filterwarnings("ignore:.*latest.*:RuntimeWarning")  # a FIFO latest: not followed
@pytest.mark.parametrize("where", ["latest", "manifest.json", "data.safetensors"])
def test_a_fifo_never_blocks_load_verify_or_the_cli(run, where):
    from gockpt.cli import main
    path = run / "latest" if where == "latest" else step_dir(run) / where
    path.unlink()
    os.mkfifo(path)
    m, o, s = fresh()
    exc = finishes(lambda: gockpt.load(str(run), m, o, scheduler=s))
    if where == "latest":  # the pointer is unusable: the newest committed checkpoint
        assert exc is None
    else:
        assert isinstance(exc, gockpt.GockptError) and where in str(exc), exc
    report = {}
    assert finishes(lambda: report.update(r=gockpt.verify(str(step_dir(run))))) is None
    assert report["r"].ok is (where == "latest")
    for cmd in ("inspect", "verify", "list"):
        assert finishes(lambda: main([cmd, str(run)])) is None
