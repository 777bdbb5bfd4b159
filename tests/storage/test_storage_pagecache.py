"""Tests of gockpt.storage.pagecache: page-cache residency of a file's byte ranges (mincore)."""

import os

from gockpt.storage import pagecache


def test_residency_of_a_file_just_written(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(3 * 65536))
    items = [(0, 4096), (65536, 65536), (131072, 10)]
    cached = pagecache.cached_items(path, items)
    groups = pagecache.split_by_residency(path, items)
    assert sorted(i for idx, _ in groups for i in idx) == [0, 1, 2]  # every item, once
    if cached is None:  # mincore cannot be asked here: everything with O_DIRECT
        assert groups == [([0, 1, 2], True)]
    else:  # just written by this process: in the page cache, read buffered
        assert cached == [True, True, True]
        assert groups == [([0, 1, 2], False)]


def test_split_puts_cached_items_first(monkeypatch):
    monkeypatch.setattr(pagecache, "cached_items", lambda path, items: [False, True, False, True])
    assert pagecache.split_by_residency("x", [None] * 4) == [([1, 3], False), ([0, 2], True)]
    monkeypatch.setattr(pagecache, "cached_items", lambda path, items: [False, False])
    assert pagecache.split_by_residency("x", [None] * 2) == [([0, 1], True)]
