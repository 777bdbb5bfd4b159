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
    ("block_bytes", 8), ("self_check", -0.1), ("on_busy", "never"), ("replay_threads", 0)])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        Config(directory="x", **{field: value})
