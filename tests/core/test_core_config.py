import pytest

from gockpt.core.config import Config
from gockpt.core.errors import ConfigError


def test_defaults_and_fixed_k():
    c = Config(directory="x")
    assert c.mode == "gockpt-o" and c.policy.replays and c.fixed_overlap_steps() is None
    assert Config(directory="x", mode="async-o", overlap_steps=5).fixed_overlap_steps() == 1
    assert Config(directory="x", mode="gockpt", overlap_steps=5).fixed_overlap_steps() == 5


@pytest.mark.parametrize("field,value", [
    ("mode", "fast"), ("overlap_steps", 0), ("overlap_steps", True), ("interval", 0),
    ("block_bytes", 8), ("self_check", -0.1), ("on_busy", "never"), ("replay_threads", 0),
    ("replicated", "module.weight"), ("replicated", [1]), ("replicated", 3),
    ("global_slices", [("w", ((4,), (0,)))]), ("global_slices", {"w": ((4,), (0, 1))}),
    ("global_slices", {"w": ((4,), (-1,))}), ("global_slices", {"w": (4, 0)})])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        Config(directory="x", **{field: value})


def test_replicated_names_and_global_slices_are_kept_as_plain_values():
    c = Config(directory="x", replicated=["a", "b", "a"], global_slices={"w": ([8], [4])})
    assert c.replicated == frozenset({"a", "b"}) and c.global_slices == {"w": ((8,), (4,))}
    assert Config(directory="x", replicated=True).replicated is True
