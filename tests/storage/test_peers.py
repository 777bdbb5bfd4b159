"""The memory tier's peers across hosts (gockpt/storage/peers.py): whose part each rank keeps,
and the bundles a part crosses in. The transfer itself, on gloo ranks declared on two hosts:
tests/test_memory_tier.py (``hosts``)."""

import os

import pytest
import torch

from gockpt.storage import peers


def test_each_rank_is_kept_by_the_rank_at_its_place_on_the_next_host():
    # ranks 0, 2 on host a; 1, 3, 4 on host b; 5 on host c (hosts ordered by lowest rank)
    ids = [7, 9, 7, 9, 9, 3]
    hosts = [peers.Hosts.of(ids, r) for r in range(6)]
    assert hosts[0].hosts == ((0, 2), (1, 3, 4), (5,))
    assert [h.peer_of(h.rank) for h in hosts] == [1, 5, 3, 5, 5, 0]
    assert [h.leader_of(h.rank) for h in hosts] == [0, 1, 0, 1, 1, 5]
    assert hosts[0].kept_by(5) == [1, 3, 4] and hosts[0].kept_by(0) == [5]
    # every rank's part is kept once, on another host than its own
    for h in hosts:
        assert h.peer_of(h.rank) not in next(g for g in h.hosts if h.rank in g)
    assert sorted(s for h in hosts for s in h.kept_by(h.rank)) == list(range(6))
    # host a holds its 2 parts and rank 5's; host c its own and those of 1, 3 and 4
    assert hosts[0].parts_on_host(0) == 3 and hosts[5].parts_on_host(5) == 4


def test_one_host_has_no_peers():
    h = peers.Hosts.of([5, 5, 5], 1)
    assert not h.several and h.peer_of(1) is None and h.kept_by(1) == []
    assert h.leader_of(2) == 0 and h.parts_on_host(1) == 3


def test_a_bundle_carries_a_part_s_files_and_refuses_paths_leaving_it(tmp_path):
    part = tmp_path / "rank-00003"
    (part / "sub").mkdir(parents=True)
    (part / "manifest.json").write_bytes(b'{"a": 1}')
    (part / "data.safetensors").write_bytes(os.urandom(1000))
    (part / "sub" / "x").write_bytes(b"")
    files = peers.part_files(str(part))
    assert sorted(files) == ["data.safetensors", "manifest.json", "sub/x"]
    name, got = peers.unpack(peers.pack("step-000000009", files))
    assert name == "step-000000009"
    peers.write_files(str(tmp_path / "copy"), got)
    for rel in files:
        assert (tmp_path / "copy" / rel).read_bytes() == (part / rel).read_bytes()

    bad = peers.pack("step-1", {"../escape": str(part / "manifest.json")})
    with pytest.raises(ValueError, match="bad entry"):
        peers.unpack(bad)
    with pytest.raises(ValueError, match="bad entry"):  # cut short: sizes beyond its end
        peers.unpack(peers.pack("step-1", files)[:-10])
    with pytest.raises(ValueError):
        peers.unpack(torch.zeros(3, dtype=torch.uint8))
    header = b'{"name": "step-1"}'  # (no file list: a header of another shape)
    other = torch.tensor(list(len(header).to_bytes(8, "little") + header), dtype=torch.uint8)
    with pytest.raises(ValueError, match="header is not one"):
        peers.unpack(other)
