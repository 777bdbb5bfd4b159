"""Round-trip and error tests of gockpt.tree."""

import collections
import json
import math
import struct

import numpy as np
import pytest
import torch

from gockpt.storage import tree


def same(a, b) -> bool:
    """Exact equality, including the type of every node and the bits of every float."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.device.type == "cpu"
            and not b.requires_grad
            and a.contiguous().reshape(-1).view(torch.uint8).tolist()
            == b.contiguous().reshape(-1).view(torch.uint8).tolist()
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        # Same keys with the same types, in the same order, and the same values.
        ka, kb = list(a), list(b)
        return len(ka) == len(kb) and all(same(x, y) and same(a[x], b[y]) for x, y in zip(ka, kb))
    return a == b


def roundtrip(obj):
    """Encode, go through strict JSON text (as a manifest does), decode."""
    tensors = {}
    data = tree.encode(obj, tensors, "state")
    text = json.dumps(data, allow_nan=False)  # must be standard JSON: no NaN/Infinity literals
    return tree.decode(json.loads(text), tensors), tensors


class Foo:
    pass


CASES = [
    None,
    True,
    False,
    0,
    -7,
    2**53,
    2**53 + 1,
    -(2**200) - 3,
    10**5000,  # beyond Python's 4300-digit str(int) limit
    0.0,
    -0.0,
    1.5,
    0.1,
    5e-324,
    1.7976931348623157e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    "",
    "héllo\x00 ✓",
    b"",
    b"\x00\xffbytes",
    [],
    (),
    (1,),
    [1, (2, [3, (4,)])],
    {},
    {"a": 1, "b": [1, 2]},
    {"__t": "tuple", "v": [1]},  # a user dict that looks like a tag must not be decoded as one
    {"x": {"__t": 5}},
    {1: "a", 2: "b"},
    {0: {"step": 3}, 1: {"step": 4}},  # optimizer state_dict style
    {1.5: 1, -0.0: 2, True: 3, None: 4, (1, "a"): 5, "s": 6},
    {(1, (2, None)): "nested tuple key"},
    collections.OrderedDict([("b", 1), ("a", 2)]),
    np.float64(1.25),
    np.float32(-0.0),
    np.float16(65504),
    np.float64("nan"),
    np.int64(-(2**63)),
    np.uint64(2**64 - 1),
    np.int8(-3),
    np.bool_(True),
    np.complex128(1 + 2j),
    np.datetime64("2024-01-02T03:04:05"),
]


@pytest.mark.parametrize("obj", CASES, ids=lambda o: type(o).__name__)
def test_roundtrip_plain(obj):
    back, tensors = roundtrip(obj)
    assert same(obj, back), (obj, back)
    assert tensors == {}


TENSORS = [
    torch.tensor(3.5),
    torch.empty(0, 4),
    torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous
    torch.randn(2, 3, dtype=torch.bfloat16),
    torch.randn(5, dtype=torch.float16),
    torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64),
    torch.tensor([True, False]),
    torch.arange(-3, 3, dtype=torch.int8),
    torch.tensor([2**62], dtype=torch.int64),
    torch.ones(2, requires_grad=True),
    torch.nn.Parameter(torch.ones(2)),
]


@pytest.mark.parametrize("t", TENSORS, ids=lambda t: str(t.dtype))
def test_roundtrip_tensor(t):
    back, tensors = roundtrip({"w": [t]})
    assert list(tensors) == ["state/0"]
    stored = tensors["state/0"]
    assert stored.is_contiguous() and not stored.requires_grad
    assert same(t.detach().clone(), back["w"][0])


def test_tensor_is_a_copy():
    t = torch.zeros(3)
    tensors = {}
    tree.encode(t, tensors, "x")
    t.add_(1)  # the caller keeps training
    assert tensors["x/0"].tolist() == [0, 0, 0]


def test_fresh_tensors_and_arrays_are_stored_as_they_are_the_others_copied():
    """``fresh``: copies of their own (an RNG state just read, a step column): stored without
    another copy; whatever is not named, or not CPU contiguous, still copied."""
    own, theirs = torch.arange(4.0), torch.arange(4.0)
    key_array, user_array = np.arange(5, dtype=np.uint32), np.arange(5, dtype=np.uint32)
    strided = torch.arange(8.0)[::2]
    tensors = {}
    enc = tree.encode({"own": own, "theirs": theirs, "key": key_array, "user": user_array,
                       "strided": strided}, tensors, "x",
                      fresh={id(own), id(key_array), id(strided)})
    stored = {name: tensors[enc[name]["k"]] for name in ("own", "theirs", "key", "user",
                                                          "strided")}
    assert stored["own"] is own and stored["theirs"] is not theirs
    assert stored["key"].data_ptr() == key_array.ctypes.data
    assert stored["user"].data_ptr() != user_array.ctypes.data
    assert stored["strided"].is_contiguous()
    theirs.add_(1), user_array.__iadd__(1), strided.add_(1)  # the caller keeps training
    back = tree.decode(enc, tensors)
    assert back["theirs"].tolist() == [0, 1, 2, 3] and back["user"].tolist() == [0, 1, 2, 3, 4]
    assert back["strided"].tolist() == [0, 2, 4, 6] and back["key"].tolist() == [0, 1, 2, 3, 4]


ARRAYS = [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.array(7, dtype=np.int64),  # 0-d
    np.zeros((0, 3), dtype=np.uint32),
    np.arange(624, dtype=np.uint32),  # numpy RNG state
    np.arange(4, dtype=">f8"),  # big-endian comes back big-endian
    np.array([1 + 2j], dtype=np.complex128),
    np.array(["ab", "c"]),
    np.arange(10, dtype=np.int16)[::3],  # non-contiguous
    np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    np.array([np.nan, -0.0], dtype=np.float16),
]


@pytest.mark.parametrize("a", ARRAYS, ids=lambda a: a.dtype.str)
def test_roundtrip_ndarray(a):
    back, tensors = roundtrip((a, "after"))
    assert same((np.ascontiguousarray(a) if a.ndim else a, "after"), back)
    assert len(tensors) == 1


def test_mixed_structure_and_keys():
    obj = {
        "state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
        "rng": ("MT19937", np.arange(3, dtype=np.uint32), 2, 0, 0.0),
    }
    back, tensors = roundtrip(obj)
    assert same(obj, back)
    assert sorted(tensors) == ["state/0", "state/1", "state/2"]


def test_prefix_keys_do_not_collide():
    tensors = {}
    a = tree.encode([torch.ones(1)], tensors, "p")
    b = tree.encode([torch.zeros(1)], tensors, "p")
    assert len(tensors) == 2
    assert tree.decode(a, tensors)[0].item() == 1 and tree.decode(b, tensors)[0].item() == 0


@pytest.mark.parametrize(
    "obj, path, typename",
    [
        ({"cfg": [1, 2, Foo()]}, "extra_state['cfg'][2]", "Foo"),
        ([lambda: 0], "extra_state[0]", "function"),
        ((1, {2: {1, 2}}), "extra_state[1][2]", "set"),
        ({"e": collections.namedtuple("P", "x")(1)}, "extra_state['e']", "P"),
        (np.array([object()]), "extra_state", None),
        ({"k": torch.ones(1, dtype=torch.complex128)}, "extra_state['k']", None),
        ({"s": torch.ones(2).to_sparse()}, "extra_state['s']", None),
    ],
)
def test_unstorable_value_names_path(obj, path, typename):
    with pytest.raises(TypeError) as exc:
        tree.encode(obj, {}, "extra_state")
    msg = str(exc.value)
    assert msg.startswith(path + ":"), msg
    if typename:
        assert f"type {typename} without pickle" in msg


def test_unstorable_key():
    with pytest.raises(TypeError, match=r"^x\['a'\]: cannot store a dict key of type frozenset"):
        tree.encode({"a": {frozenset(): 1}}, {}, "x")


def test_subclass_is_not_silently_downcast():
    class MyInt(int):
        pass

    with pytest.raises(TypeError, match="MyInt"):
        tree.encode([MyInt(3)], {}, "x")


def test_cycle_is_an_error():
    a = [1]
    a.append(a)
    with pytest.raises(ValueError, match="contains itself"):
        tree.encode(a, {}, "x")
    shared = [1]
    assert tree.decode(tree.encode([shared, shared], {}, "x"), {}) == [[1], [1]]  # sharing is not a cycle


@pytest.mark.parametrize(
    "data",
    [
        {"__t": "pickle", "v": "..."},
        {"__t": "tensor", "k": "missing/0"},
        {"__t": "tuple"},
        {"__t": "float", "v": "1e400"},
        {"__t": "dict", "v": [[[1], 2]]},  # a list cannot be a key
        {"__t": "ndarray", "k": "t", "dtype": "|O", "shape": [1]},
        [1, {"__t": "bytes", "v": "!!"}],
    ],
)
def test_decode_rejects_malformed(data):
    with pytest.raises(ValueError):
        tree.decode(data, {"t": torch.zeros(8, dtype=torch.uint8)})


def test_plain_output_stays_readable():
    data = tree.encode({"lr": 0.1, "betas": [0.9, 0.99], "name": "adam"}, {}, "x")
    assert data == {"lr": 0.1, "betas": [0.9, 0.99], "name": "adam"}
    assert not math.isnan(data["lr"])


SCALARS = [
    torch.tensor(3.0), torch.tensor(-0.0), torch.tensor(1, dtype=torch.int32).view(torch.float32),
    torch.tensor(0x7FC12345, dtype=torch.int32).view(torch.float32),  # a NaN with a payload
    torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(-7.25, dtype=torch.float16),
    torch.tensor(2**63 - 1, dtype=torch.int64), torch.tensor(True), torch.tensor(-3, dtype=torch.int8),
    torch.tensor(1 + 2j, dtype=torch.complex64), torch.tensor(float("inf"), dtype=torch.float64),
]


@pytest.mark.parametrize("t", SCALARS, ids=lambda t: f"{t.dtype}")
def test_inline_scalars_round_trip_bit_for_bit(t):
    tensors = {}
    enc = tree.encode({"step": t}, tensors, "s", inline_scalars=True)
    assert tensors == {} and enc["step"]["__t"] == "scalar"
    back = tree.decode(json.loads(json.dumps(enc)), tensors)["step"]
    assert back.dtype == t.dtype and back.shape == () and back.device.type == "cpu"
    assert torch.equal(back.reshape(1).view(torch.uint8), t.reshape(1).view(torch.uint8))


def test_inline_scalars_leave_other_tensors_stored():
    tensors = {}
    enc = tree.encode([torch.tensor(1.0), torch.ones(1)], tensors, "s", inline_scalars=True)
    assert list(tensors) == ["s/0"] and enc[0]["__t"] == "scalar" and enc[1]["__t"] == "tensor"


def test_a_malformed_inline_scalar_is_refused():
    with pytest.raises(ValueError, match="scalar"):
        tree.decode({"__t": "scalar", "dtype": "F32", "bits": "x"}, {})


def test_a_plan_s_plain_ints_are_stored_as_a_list_without_a_check_per_item():
    # PlainInts (a plan's indices, made plain by gockpt) round-trips as the list it is, and
    # the encoder does not check its items again: shown with an int a plain list would tag
    # (beyond 2**53; a PlainInts never holds one)
    from gockpt.core.lists import PlainInts
    back, _ = roundtrip({"params": PlainInts([3, 1, 2])})
    assert back == {"params": [3, 1, 2]} and type(back["params"]) is list
    encoded = tree.encode({"p": PlainInts([1, 2 ** 60])}, {}, "x")["p"]
    assert encoded == [1, 2 ** 60] and type(encoded) is list
    assert tree.encode([1, 2 ** 60], {}, "x")[1] != 2 ** 60  # (a plain list: checked, tagged)
