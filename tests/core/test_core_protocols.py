"""The protocols at the seams (gockpt.core.protocols) are what their implementations offer:
every method a protocol names exists on each implementation with parameters a caller written
against the protocol can pass."""

import inspect

import pytest

from gockpt.core import protocols
from gockpt.integrations.deepspeed.adapter import DeepSpeedCpuAdamAdapter, DeepSpeedCudaAdamAdapter
from gockpt.replay.adapters import AdamAdapter
from gockpt.storage import CheckpointWriter


def _methods(proto):
    return {n: v for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def _callable_as(impl_fn, proto_fn) -> bool:
    """Every parameter of the protocol's signature is accepted by the implementation, under
    the same name and kind (positional or keyword-only)."""
    have = inspect.signature(impl_fn).parameters
    for name, p in inspect.signature(proto_fn).parameters.items():
        mine = have.get(name)
        if mine is None or (mine.kind is inspect.Parameter.KEYWORD_ONLY) != (
                p.kind is inspect.Parameter.KEYWORD_ONLY):
            return False
    return True


@pytest.mark.parametrize("proto,impl", [
    (protocols.StorageWriter, CheckpointWriter),
    (protocols.ReplayAdapter, AdamAdapter),
    (protocols.ReplayAdapter, DeepSpeedCpuAdamAdapter),
    (protocols.ReplayAdapter, DeepSpeedCudaAdamAdapter),
])
def test_each_implementation_offers_its_protocols_methods(proto, impl):
    methods = _methods(proto)
    assert methods, proto
    for name, fn in methods.items():
        assert callable(getattr(impl, name, None)), f"{impl.__name__} lacks {name}()"
        assert _callable_as(getattr(impl, name), fn), \
            f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))} does not accept " \
            f"the protocol's {name}{inspect.signature(fn)}"


def test_the_check_sees_a_missing_or_renamed_parameter():
    class Bad:
        def begin(self, shapes): ...

        def write(self, name, tensor, start=0): ...  # start not keyword-only

    assert not _callable_as(Bad.begin, protocols.StorageWriter.begin)
    assert not _callable_as(Bad.write, protocols.StorageWriter.write)
    assert _callable_as(CheckpointWriter.write, protocols.StorageWriter.write)
