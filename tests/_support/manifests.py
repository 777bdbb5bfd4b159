"""Manifests rewritten on purpose (tests of what the loader does with valid-looking but wrong
values): read without checking the seal, written back sealed as gockpt's writer seals them --
what a buggy writer, or a person editing the file, would produce."""

import json
import os

from gockpt.storage.commit import read_latest, write_latest
from gockpt.storage.format import MANIFEST_FILE, manifest_seal, seal_json, seal_manifest


def manifest_path(path) -> str:
    """``path`` itself when it names a manifest file, else its ``manifest.json``."""
    path = os.fspath(path)
    return path if path.endswith(".json") else os.path.join(path, MANIFEST_FILE)


def read_raw(path) -> dict:
    """The manifest of checkpoint ``path`` as JSON, its seal not checked."""
    with open(manifest_path(path), encoding="utf-8") as f:
        return json.load(f)


def write_sealed(path, data: dict) -> None:
    """Replace the manifest of checkpoint ``path`` with ``data``, sealed (and the ``latest``
    beside it, if it names this checkpoint, with the new seal: as a writer would)."""
    data = {k: v for k, v in data.items() if k != "manifest_crc32c"}
    _write(path, seal_manifest(data))


def _write(path, sealed: bytes) -> None:
    with open(manifest_path(path), "wb") as f:
        f.write(sealed)
    checkpoint = os.path.dirname(manifest_path(path))
    root, name = os.path.split(checkpoint)
    try:
        pointed, seal = read_latest(root)
    except ValueError:
        return
    if pointed == name and seal is not None:
        write_latest(root, name, manifest_seal(sealed))


def write_sealed_text(path, text: str) -> None:
    """Replace the manifest of checkpoint ``path`` with the JSON text ``text``, sealed (for
    text no JSON encoder would produce)."""
    _write(path, seal_json(text.encode("utf-8")))


def rewrite(path, change) -> dict:
    """Apply ``change(manifest)`` (in place) to the manifest of ``path``, sealed again."""
    data = read_raw(path)
    change(data)
    write_sealed(path, data)
    return data
