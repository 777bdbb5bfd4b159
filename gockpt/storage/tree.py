"""Lossless JSON encoding of small Python state, without pickle.

``encode`` turns a nested structure (the kind found in ``extra_state``, an
optimizer's ``param_groups`` or an RNG state) into plain JSON values; tensors and
numpy arrays are moved out into a ``tensors`` dict (to be written to
``data.safetensors``) and replaced by a placeholder. ``decode`` reverses it and
gives back values of exactly the original types.

Values that JSON cannot represent exactly are written as tagged objects
``{"__t": <tag>, ...}``:

==========  =====================================================  ==========================
tag         used for                                               fields
==========  =====================================================  ==========================
``float``   inf, -inf, nan (JSON has no literal for them)          ``v``: "inf" / "-inf" / "nan"
``int``     ints outside +-2**53 (JSON readers use doubles;        ``v``: hex string
            Python limits decimal ``str(int)`` to 4300 digits)
``bytes``   bytes                                                  ``v``: base64
``tuple``   tuple                                                  ``v``: list
``dict``    dict with a non-str key, or a str dict that contains   ``v``: list of [key, value]
            the tag key ``"__t"`` itself (escaping)
``odict``   collections.OrderedDict                                ``v``: list of [key, value]
``tensor``  torch.Tensor                                           ``k``: key in ``tensors``
``ndarray`` numpy.ndarray                                          ``k``, ``dtype``, ``shape``
``np``      numpy scalar (np.float32(1.5), np.int64(3), ...)       ``dtype``, ``hex``: raw bytes
``scalar``  0-dim CPU tensor, with ``inline_scalars=True``          ``dtype``, ``bits``: raw bits (int)
            (an optimizer's step counters: thousands of them
            cost one JSON value each, not one stored tensor)
==========  =====================================================  ==========================

Plain dicts with str keys, lists, str, bool, None and small ints/finite floats
stay as they are, so a manifest stays readable.
"""

from __future__ import annotations

import base64
import collections
import math
from typing import Collection

import numpy as np
import torch

from ..core.lists import PlainInts
from .format import CODE_TO_DTYPE, DTYPE_TO_CODE

__all__ = ["encode", "decode", "tensor_refs"]

TAG = "__t"

# Integers beyond this are not exactly representable as a JSON number by most
# readers (they parse doubles), so they are written as tagged hex strings.
_MAX_PLAIN_INT = 2**53

_KEY_TYPES = (str, int, float, bool, type(None))

_HINT = (
    "convert it to plain data (dict/list/tuple/str/int/float/bool/bytes/None), "
    "a torch.Tensor or a numpy array first"
)


def _is_key(k) -> bool:
    """True if ``k`` may be a dict key: exactly one of the supported scalar types, or a tuple of keys."""
    if type(k) is tuple:
        return all(_is_key(x) for x in k)
    return type(k) in _KEY_TYPES


_TENSOR_DTYPES = frozenset(DTYPE_TO_CODE)


_CONTAINERS = (list, tuple, dict, collections.OrderedDict, PlainInts)


def encode(obj, tensors: dict, prefix: str, *, inline_scalars: bool = False,
           fresh: Collection[int] = ()):
    """Encode ``obj`` as JSON-compatible values, moving tensors and arrays into ``tensors``.

    Each tensor or array is stored as a CPU contiguous copy (detached, so
    ``requires_grad`` is false) under the key ``f"{prefix}/{n}"``, n = 0, 1, ...
    (keys already in ``tensors`` are skipped, so several calls may share one dict).
    ``prefix`` also names the root of the structure in error messages. With
    ``inline_scalars``, 0-dim CPU tensors are written inline as their raw bytes instead
    (they decode to equal tensors, bit for bit). ``fresh``: the id()s of tensors and arrays
    made for this encoding and held nowhere else (a state just read out: a copy of its own),
    stored as they are where already CPU contiguous ones -- not copied again.

    Raises ``TypeError`` naming the path inside the structure (for example
    ``extra_state['cfg'][2]``) for anything that cannot be stored without pickle,
    and ``ValueError`` if the structure contains itself.
    """
    return _Encoder(tensors, prefix, inline_scalars, fresh).value(obj, prefix)


class _Encoder:
    """The state of one :func:`encode` call: where tensors go and under which keys, and the
    containers being walked (to refuse a structure that contains itself)."""

    def __init__(self, tensors: dict, prefix: str, inline_scalars: bool = False,
                 fresh: Collection[int] = ()):
        self.tensors, self.prefix, self.inline_scalars = tensors, prefix, inline_scalars
        self.fresh = fresh
        self.counter = iter(range(1 << 62))
        self.active: set = set()

    def value(self, x, path):
        """The encoding of ``x``; ``path`` says where it sits (rendered only for an error)."""
        t = type(x)
        # Exact type checks, not isinstance: a subclass (bool is an int, an
        # IntEnum is an int, np.float64 is a float, a namedtuple is a tuple)
        # would otherwise come back as its base type and the round trip would lie.
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return _encode_int(x)
        if t is float:
            return _encode_float(x)
        if t is bytes:
            return {TAG: "bytes", "v": base64.b64encode(x).decode("ascii")}
        if isinstance(x, torch.Tensor):
            if self.inline_scalars and x.dim() == 0 and x.device.type == "cpu" \
                    and x.dtype in _TENSOR_DTYPES and not x.is_quantized:
                return _encode_tensor_scalar(x)
            return {TAG: "tensor", "k": self.store_tensor(x, path)}
        if t is np.ndarray:
            return self.store_array(x, path)
        if isinstance(x, np.generic):
            return _encode_np_scalar(x, _render(path))
        if t in _CONTAINERS:
            return self.container(x, path)
        raise TypeError(f"{_render(path)}: cannot store object of type {t.__qualname__} without "
                        f"pickle; {_HINT}")

    def container(self, x, path: str):
        """A list, tuple, dict or OrderedDict, refused if it is already being walked."""
        if id(x) in self.active:
            raise ValueError(f"{_render(path)}: the structure contains itself; it cannot be stored")
        self.active.add(id(x))
        try:
            if type(x) is list or type(x) is PlainInts:
                return self.items(x, path)
            if type(x) is tuple:
                return {TAG: "tuple", "v": self.items(x, path)}
            return self.mapping(x, path)
        finally:
            self.active.discard(id(x))

    def items(self, seq, path: str) -> list:
        if type(seq) is PlainInts:  # checked when made (a plan's indices): not again
            return list(seq)
        if seq and type(seq[0]) is int and _plain_ints(seq):
            return list(seq)  # e.g. a param group's "params": thousands of indices
        return [self.value(v, (path, i)) for i, v in enumerate(seq)]

    def mapping(self, d, path: str):
        """A str-keyed dict as a JSON object; any other dict (or one holding the tag key, or an
        OrderedDict) as a tagged list of [key, value] pairs."""
        plain = type(d) is dict and TAG not in d and all(type(k) is str for k in d)
        if plain:
            return {k: self.value(v, (path, k)) for k, v in d.items()}
        items = []
        for k, v in d.items():
            if not _is_key(k):
                raise TypeError(
                    f"{_render(path)}: cannot store a dict key of type {type(k).__qualname__} ({k!r:.60}) "
                    "without pickle; keys must be str, int, float, bool, None or tuples of those"
                )
            items.append([self.value(k, (path, _KeyOf(k))), self.value(v, (path, k))])
        return {TAG: "odict" if type(d) is collections.OrderedDict else "dict", "v": items}

    def new_key(self) -> str:
        while True:
            key = f"{self.prefix}/{next(self.counter)}"
            if key not in self.tensors:
                return key

    def store_tensor(self, x: torch.Tensor, path: str) -> str:
        if x.layout != torch.strided or x.is_quantized or x.device.type == "meta":
            raise TypeError(f"{_render(path)}: cannot store a {x.layout} / {x.device.type} "
                            f"tensor; {_HINT}")
        if x.dtype not in _TENSOR_DTYPES:
            raise TypeError(f"{_render(path)}: cannot store a tensor of dtype {x.dtype}; convert "
                            "it to a supported dtype")
        key = self.new_key()
        if id(x) in self.fresh and x.device.type == "cpu" and not x.requires_grad and \
                x.is_contiguous():  # (a copy of its own already)
            self.tensors[key] = x
            return key
        # copy=True: the caller may keep mutating its tensor after encode returns.
        self.tensors[key] = x.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        return key

    def store_array(self, a: np.ndarray, path: str) -> dict:
        if a.dtype.hasobject or a.dtype.fields is not None or a.dtype.itemsize == 0:
            raise TypeError(f"{_render(path)}: cannot store a numpy array of dtype {a.dtype} "
                            f"without pickle; {_HINT}")
        # Saved as raw bytes (a flat uint8 tensor) so that every fixed-size numpy
        # dtype round-trips, including ones torch lacks (complex128, str, datetime64);
        # dtype.str records the byte order, so the array comes back bit-identical.
        raw = a.reshape(-1).view(np.uint8) if id(a) in self.fresh and a.flags.c_contiguous \
            else np.array(a, order="C", copy=True).reshape(-1).view(np.uint8)
        key = self.new_key()
        self.tensors[key] = torch.from_numpy(raw)
        return {TAG: "ndarray", "k": key, "dtype": a.dtype.str, "shape": list(a.shape)}


class _KeyOf:
    """A dict key as a path component: ``<key 'k'>``."""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


def _render(path) -> str:
    """The text of a path built as nested (parent, index or key) pairs: ``extra_state['cfg'][2]``."""
    parts = []
    while type(path) is tuple:
        path, key = path
        parts.append(f"<key {key.key!r}>" if type(key) is _KeyOf else f"[{key!r}]")
    return path + "".join(reversed(parts))


def _plain_ints(seq) -> bool:
    """Whether every item of ``seq`` is an int (exactly) that JSON holds as it is."""
    return set(map(type, seq)) == {int} and -_MAX_PLAIN_INT <= min(seq) and \
        max(seq) <= _MAX_PLAIN_INT


def _encode_int(x: int):
    if -_MAX_PLAIN_INT <= x <= _MAX_PLAIN_INT:
        return x
    return {TAG: "int", "v": hex(x)}


def _encode_float(x: float):
    if math.isfinite(x):
        return x  # json writes repr(), the shortest string that round-trips, -0.0 included
    return {TAG: "float", "v": repr(x)}


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _encode_tensor_scalar(x: torch.Tensor) -> dict:
    """A 0-dim tensor as its dtype and raw bits, as an int (exact: NaN payloads, -0.0)."""
    return {TAG: "scalar", "dtype": DTYPE_TO_CODE[x.dtype],
            "bits": x.detach().view(_BITS[x.element_size()]).item()}


def _encode_np_scalar(x: np.generic, path: str) -> dict:
    if x.dtype.kind not in "biufcmM":
        raise TypeError(f"{path}: cannot store numpy scalar of type {type(x).__qualname__} without pickle; {_HINT}")
    # Raw bytes, not x.item(): item() loses float16/longdouble bits and nan payloads.
    return {TAG: "np", "dtype": x.dtype.str, "hex": x.tobytes().hex()}


def decode(data, tensors: dict):
    """Rebuild the value ``encode`` produced; tensors and arrays are looked up in ``tensors``.

    Tensors come back as the CPU tensors found in ``tensors`` (not copied);
    arrays come back as numpy arrays with the original dtype and shape.
    Raises ``ValueError`` if ``data`` is not something ``encode`` could have produced, or is
    nested deeper than :data:`MAX_DEPTH`.
    """
    return _Decoder(tensors).value(data, "state")


MAX_DEPTH = 100
"""Containers nested deeper than this are refused by :func:`decode` (the state gockpt stores is
a few levels deep; a damaged or crafted manifest must not exhaust the stack)."""


class _Decoder:
    """One :func:`decode` call: the stored tensors that tagged values refer to."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.depth = 0

    def value(self, x, path: str):
        t = type(x)
        if x is None or t in (bool, int, float, str):
            return x
        if self.depth >= MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            return self.container(x, t, path)
        finally:
            self.depth -= 1

    def container(self, x, t, path: str):
        if t is list:
            return [self.value(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if t is not dict:
            raise ValueError(f"{path}: unexpected JSON value of type {t.__name__}")
        if TAG not in x:
            return {k: self.value(v, f"{path}[{k!r}]") for k, v in x.items()}
        try:
            return self.tagged(x, path)
        except (KeyError, TypeError, ValueError, OverflowError, IndexError, RuntimeError) as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise  # already names the place inside this value
            raise ValueError(f"{path}: malformed {x.get(TAG)!r} value: {e!r}") from e

    def tagged(self, x: dict, path: str):
        tag = x[TAG]
        if tag == "tuple":
            return tuple(self.value(v, f"{path}[{i}]") for i, v in enumerate(x["v"]))
        if tag in ("dict", "odict"):
            return self.mapping(x["v"], collections.OrderedDict() if tag == "odict" else {}, path)
        if tag in ("float", "int", "bytes", "np"):
            return _decode_scalar(tag, x, path)
        if tag == "tensor":
            return self.lookup(x["k"], path)
        if tag == "scalar":
            return _decode_tensor_scalar(x, path)
        if tag == "ndarray":
            return self.array(x, path)
        raise ValueError(f"{path}: unknown tag {tag!r}")

    def mapping(self, pairs, out: dict, path: str) -> dict:
        for k, v in pairs:
            key = self.value(k, f"{path}<key>")
            if not _is_key(key):
                raise ValueError(f"{path}: invalid dict key {key!r}")
            out[key] = self.value(v, f"{path}[{key!r}]")
        return out

    def array(self, x: dict, path: str) -> np.ndarray:
        dtype = np.dtype(x["dtype"])
        if dtype.hasobject:
            raise ValueError(f"{path}: object arrays are not allowed")
        raw = self.lookup(x["k"], path).reshape(-1).view(torch.uint8).numpy()
        return raw.view(dtype).reshape(x["shape"])

    def lookup(self, key, path: str) -> torch.Tensor:
        if key not in self.tensors:
            raise ValueError(f"{path}: tensor {key!r} is missing")
        return self.tensors[key]


def _decode_tensor_scalar(x: dict, path: str) -> torch.Tensor:
    """The 0-dim tensor of a tagged ``scalar``."""
    dtype, bits = CODE_TO_DTYPE.get(x["dtype"]), x["bits"]
    if dtype is None or dtype.itemsize not in _BITS or type(bits) is not int:
        raise ValueError(f"{path}: invalid scalar {x!r:.80}")
    return torch.tensor(bits, dtype=_BITS[dtype.itemsize]).view(dtype)


def _decode_scalar(tag: str, x: dict, path: str):
    """The value of a tagged ``float``, ``int``, ``bytes`` or ``np`` scalar."""
    if tag == "float":
        if x["v"] not in ("inf", "-inf", "nan"):
            raise ValueError(f"{path}: invalid float {x['v']!r}")
        return float(x["v"])
    if tag == "int":
        return int(x["v"], 16)
    if tag == "bytes":
        return base64.b64decode(x["v"], validate=True)
    dtype = np.dtype(x["dtype"])
    if dtype.kind not in "biufcmM":
        raise ValueError(f"{path}: numpy scalar of dtype {dtype} is not allowed")
    raw = bytes.fromhex(x["hex"])
    if len(raw) != dtype.itemsize:
        raise ValueError(f"{path}: a numpy {dtype} scalar is {dtype.itemsize} bytes, not {len(raw)}")
    return np.frombuffer(raw, dtype=dtype)[0]


def tensor_refs(encoded) -> dict:
    """Stored tensor key -> where it sits in the value ``encoded`` (``state[0]['exp_avg']``),
    read from an encoding alone (no data, nothing decoded; malformed parts are skipped)."""
    return _tensor_refs(encoded, "", {})


def _tensor_refs(encoded, path: str, out: dict) -> dict:
    """Map each tensor key an encoding refers to to its place in the value."""
    if isinstance(encoded, list):
        for i, v in enumerate(encoded):
            _tensor_refs(v, f"{path}[{i}]", out)
    elif isinstance(encoded, dict):
        tag = encoded.get(TAG)
        if tag is None:
            for k, v in encoded.items():
                _tensor_refs(v, f"{path}[{k!r}]" if path else str(k), out)
        elif tag in ("tensor", "ndarray") and isinstance(encoded.get("k"), str):
            out[encoded["k"]] = path
        elif tag == "tuple" and isinstance(encoded.get("v"), list):
            _tensor_refs(encoded["v"], path, out)
        elif tag in ("dict", "odict") and isinstance(encoded.get("v"), list):
            for pair in encoded["v"]:
                if isinstance(pair, list) and len(pair) == 2:
                    key = pair[0] if not isinstance(pair[0], dict) else "<key>"
                    _tensor_refs(pair[1], f"{path}[{key!r}]", out)
    return out
