"""The loader under attack: seeded random damage to real checkpoints -- bytes flipped, files
cut, deleted or replaced by special files (FIFOs, directories, links to /dev/zero or to
themselves), manifests mutated as JSON, and manifests whose storage fields are rewritten and
sealed again -- each followed by gockpt.load and gockpt.verify, which must give the identical
state or a gockpt error that names the damage, within a time limit, never another exception
or a crash. A longer run: experiments/fuzz_load.py."""

import collections

import pytest

from tests._support import fuzz_attacks as F

pytestmark = pytest.mark.slow

ATTACKS_PER_SEED = 500


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz") / "run")
    F.make_template(root)
    return root, F.references(root)


@pytest.mark.parametrize("seed", [1, 2])
def test_every_attack_loads_identically_or_is_named(template, tmp_path, seed):
    root, refs = template
    outcomes = collections.Counter()
    wrong = F.run_attacks(root, str(tmp_path), seed, ATTACKS_PER_SEED, refs,
                          on_result=lambda i, attack, why: outcomes.update([attack.kind]))
    assert not wrong, F.summary(ATTACKS_PER_SEED, wrong)
    assert sum(outcomes.values()) == ATTACKS_PER_SEED
    assert set(outcomes) >= {"flip", "truncate", "delete", "special", "json", "sealed"}
