"""gockpt._tensors (the hooks' reads of many tensors in one C++ pass) reads what Python reads:
plain tensors, Parameters, tensor subclasses (through Python), None, sparse and strided views."""

import numpy as np
import pytest
import torch

from gockpt import _tensors


class Traced(torch.Tensor):
    """A subclass whose attribute reads go through __torch_function__ (as a DTensor's would)."""

    calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def _tensors_of_every_kind():
    plain = torch.randn(3, 4)
    param = torch.nn.Parameter(torch.randn(2, 5))
    view = torch.randn(4, 3).t()  # not contiguous
    traced = torch.randn(6).as_subclass(Traced)
    half = torch.zeros(3, dtype=torch.bfloat16)
    sparse = torch.zeros(2, 3).to_sparse()
    plain.add_(1)
    param.data.mul_(2)  # (.data: the parameter's version is untouched)
    view.add_(1)
    view.add_(1)
    return [plain, param, None, view, traced, half, sparse]


def test_scan_reads_what_python_reads_in_one_pass():
    tensors = _tensors_of_every_kind()
    Traced.calls.clear()
    at, version, flags = _tensors.scan(tensors)
    assert Traced.calls, "a subclass is read through Python (its __torch_function__ ran)"
    strided = [t is not None and t.layout == torch.strided for t in tensors]
    assert at.tolist() == [t.data_ptr() if s else 0 for t, s in zip(tensors, strided)]
    assert version.tolist() == [0 if t is None else t._version for t in tensors]
    assert version.tolist()[:4] == [1, 0, 0, 2]  # (so that a change would show)
    expect = [0 if t is None else
              _tensors.PRESENT
              | (_tensors.CONTIGUOUS if s and t.is_contiguous() else 0)
              | (_tensors.DENSE_FLOAT32 if s and t.dtype == torch.float32 else 0)
              for t, s in zip(tensors, strided)]
    assert flags.tolist() == expect
    assert _tensors.addresses(tensors[:5]).tolist() == at[:5].tolist()


def test_reads_refuse_what_is_not_a_tensor():
    with pytest.raises(TypeError, match="item 1 is a int, not a tensor"):
        _tensors.scan([torch.zeros(1), 1])
    with pytest.raises(TypeError, match="not a dict"):
        _tensors.values([{}, [1]], "step")


def test_strides_match_compares_each_tensor_with_its_planned_strides():
    tensors = [torch.zeros(2, 3), torch.zeros(3, 2).t(), torch.zeros(4).as_subclass(Traced)]
    planned = [t.stride() for t in tensors]
    assert _tensors.strides_match(tensors, planned)
    assert not _tensors.strides_match(tensors, planned[:2] + [(2,)])
    assert not _tensors.strides_match(tensors, [(3, 1), (2, 1), (1,)])  # the view's differ
    assert not _tensors.strides_match(tensors, [(3,), (1, 2), (1,)])  # another length
    assert not _tensors.strides_match(tensors, planned[:2])


def test_grads_and_values_read_each_parameters_gradient_and_each_dicts_entry():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    params[0].grad, params[2].grad = torch.ones(2), torch.full((2,), 2.0)
    traced = torch.nn.Parameter(torch.zeros(2)).as_subclass(Traced)
    traced.grad = torch.ones(2)
    got = _tensors.grads(params + [traced])
    assert got[0] is params[0].grad and got[1] is None and got[2] is params[2].grad
    assert torch.equal(got[3], traced.grad)
    step = torch.tensor(3.0)
    assert _tensors.values([{"step": step}, None, {}], "step") == [step, None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_stack_scalars_copies_the_bytes_of_0_dim_cpu_tensors(dtype):
    values = [torch.tensor(v).to(dtype) for v in (1.0, 3.0, 2.0 ** 40 + 1, -0.0)]
    got = _tensors.stack_scalars(values)
    assert got.dtype == dtype and torch.equal(got, torch.stack(values))
    assert torch.equal(got.view(torch.uint8), torch.stack(values).view(torch.uint8))  # bitwise
    values[0].add_(1)  # a copy, not a view
    assert not torch.equal(got, torch.stack(values))


def test_stack_scalars_leaves_everything_else_to_torch_stack():
    one = torch.tensor(1.0)
    assert _tensors.stack_scalars([]) is None
    assert _tensors.stack_scalars([one, torch.tensor(1.0, dtype=torch.float64)]) is None
    assert _tensors.stack_scalars([one, torch.ones(1)]) is None  # not 0-dim
    assert _tensors.stack_scalars([one, torch.tensor(1.0).as_subclass(Traced)]) is None
    assert _tensors.stack_scalars([one, torch.tensor(1.0, device="meta")]) is None
    assert _tensors.stack_scalars([1, one]) is None  # (the first not a tensor: DeepSpeed's int)


def test_gather_scan_and_moved_read_picked_tensors_and_find_writes_and_moves():
    tensors = _tensors_of_every_kind()
    index = np.array([4, 0, 2, 3], dtype=np.int64)
    picked, at, version, flags, every = _tensors.gather_scan(tensors, index, None)
    assert picked == [tensors[i] for i in index.tolist()]
    assert [a.tolist() for a in (at, version, flags)] == \
        [a.tolist() for a in _tensors.scan(picked)]
    assert every == np.bitwise_and.reduce(flags[flags != 0])  # (the view: not contiguous)
    assert not every & _tensors.CONTIGUOUS
    dicts = [{"exp_avg": tensors[0]}, None, {}, {"exp_avg": tensors[1]}]
    picked, at, _, flags, every = _tensors.gather_scan(dicts, np.arange(4), "exp_avg")
    assert picked == [tensors[0], None, None, tensors[1]] and at[1] == at[2] == 0
    assert every == _tensors.PRESENT | _tensors.CONTIGUOUS | _tensors.DENSE_FLOAT32
    assert _tensors.gather_scan([None], np.zeros(1, np.int64), "k")[4] == 0xFF  # none present
    with pytest.raises(IndexError):
        _tensors.gather_scan(tensors, np.array([7], dtype=np.int64), None)
    # moved(): the positions written (version) or moved to other memory (address) since
    at, version, _ = _tensors.scan(picked)
    assert _tensors.moved(picked, at, version).tolist() == []
    with torch.no_grad():
        picked[3].add_(1)  # written in place
    picked[0].data = torch.zeros(3, 4)  # moved: its version as it was
    assert _tensors.moved(picked, at, version).tolist() == [0, 3]
    # moved_labels(): the same for several columns at once, as their labels (any sequence)
    others = [torch.zeros(2), torch.ones(2)]
    o_at, o_version, _ = _tensors.scan(others)
    columns = [(np.array([40, 41, 42, 43], dtype=np.int64), picked, at, version),
               ([7, 8], others, o_at, o_version)]
    assert _tensors.moved_labels(columns) == [40, 43]
    others[1].mul_(2)
    assert _tensors.moved_labels(columns) == [40, 43, 8]
    assert all(type(x) is int for x in _tensors.moved_labels(columns))
    with pytest.raises(ValueError):
        _tensors.moved_labels([([1], others, o_at[:1], o_version[:1])])


def test_segment_sources_reads_every_role_of_a_group_in_one_pass():
    params = [torch.zeros(6), torch.zeros(4), torch.zeros(5)]
    states = [{"exp_avg": torch.ones(6)}, None, {"exp_avg": torch.ones(5)}]
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    roles = [(params, i64(0, 2), None, i64(0, 0, 1), i64(0, 8, 4)),  # rows: slot 0 twice, 2
             (states, i64(0, 1), "exp_avg", i64(1, 0), i64(0, 12))]   # rows: slot 1 (none), 0
    src, scans, every, zeros, strides_ok = _tensors.segment_sources(roles, 0)
    p, e = params, states[0]["exp_avg"]
    assert strides_ok  # (none checked)
    assert src.tolist() == [p[0].data_ptr(), p[0].data_ptr() + 8, p[2].data_ptr() + 4,
                            0, e.data_ptr() + 12]
    assert zeros == 1 and every == _tensors.PRESENT | _tensors.CONTIGUOUS | \
        _tensors.DENSE_FLOAT32
    for (items, index, key, _, _), (tensors, at, version, flags) in zip(roles, scans):
        want = _tensors.gather_scan(items, index, key)
        assert tensors == want[0]
        assert [a.tolist() for a in (at, version, flags)] == [a.tolist() for a in want[1:4]]
    assert _tensors.segment_sources(roles, 99)[0].tolist()[3] == 99  # (absent: from `zero`)
    assert not _tensors.segment_sources(
        [([torch.zeros(3, 4).t()], i64(0), None, i64(0), i64(0))], 0)[2] & _tensors.CONTIGUOUS
    with pytest.raises(IndexError):
        _tensors.segment_sources([(params, i64(0), None, i64(1), i64(0))], 0)
    with pytest.raises(TypeError):  # (a role is a tuple)
        _tensors.segment_sources([[params, i64(0), None, i64(0), i64(0)]], 0)
    # the planned strides of the tensors read, where given (per position in the items)
    params[2] = torch.zeros(5, 2).t()  # (its planned strides below: (1, 2))
    planned = [(1,), (1,), (1, 2)]
    checked = lambda index, strides: _tensors.segment_sources(  # noqa: E731
        [(params, i64(*index), None, i64(*range(len(index))), i64(*[0] * len(index)),
          strides)], 0)[4]
    assert checked((0, 2), planned) and checked((0, 2), None)
    assert not checked((2,), [(1,), (1,), (2, 1)]) and not checked((0,), [(1, 1)] * 3)
    assert checked((1,), [(1,), (1,), "not read"])  # (only the tensors read are checked)
    with pytest.raises(IndexError):
        checked((2,), planned[:2])


def test_scalar_floats_reads_0_dim_cpu_scalars_and_gives_up_on_the_rest():
    dicts = [{"step": torch.tensor(3.0)}, None, {},
             {"step": torch.tensor(2 ** 40, dtype=torch.int64)},
             {"step": torch.tensor(5.0, dtype=torch.float64)}]
    assert _tensors.scalar_floats(dicts, "step", -1.0).tolist() == \
        [3.0, -1.0, -1.0, 2.0 ** 40, 5.0]
    for odd in (7, torch.tensor(1.0, dtype=torch.bfloat16), torch.ones(1),
                torch.tensor(1.0).as_subclass(Traced)):
        assert _tensors.scalar_floats([{"step": odd}], "step", 0.0) is None
    dicts = [{"step": torch.tensor(3.0)}, None, {"step": torch.tensor(7, dtype=torch.int64)}]
    assert _tensors.scalar_floats(dicts, "step", -1.0, [2, 0, 1, 2]).tolist() == \
        [7.0, 3.0, -1.0, 7.0]  # (dicts[i] for i in index)
    assert _tensors.scalar_floats(dicts, "step", 0.0, [np.int64(2)]).tolist() == [7.0]
    with pytest.raises(IndexError):
        _tensors.scalar_floats(dicts, "step", 0.0, [3])


def test_dict_values_read_what_each_dict_holds_now_however_it_changed():
    # DictValues reads a dict again only where it changed since its last read: every kind of
    # change is seen (each read compared with scalar_floats', which looks every key up)
    steps = [torch.tensor(float(i)) for i in range(4)]
    dicts = [{"step": t, "exp_avg": torch.zeros(2)} for t in steps]
    cache = _tensors.DictValues("step")

    def read(index=None):
        got = cache.scalar_floats(dicts, -1.0, index)
        want = _tensors.scalar_floats(dicts, "step", -1.0, None if index is None
                                      else list(np.asarray(index).tolist()))
        assert (got is None) == (want is None)
        return None if got is None else got.tolist()

    assert read() == [0.0, 1.0, 2.0, 3.0]
    steps[1].add_(1)  # in place: the same tensor, read anew
    assert read() == [0.0, 2.0, 2.0, 3.0]
    dicts[0]["step"] = torch.tensor(9.0)  # another tensor under the key
    del dicts[2]["step"]  # the key removed
    dicts[3] = {"step": torch.tensor(7.0)}  # another dict at that place
    assert read() == [9.0, 2.0, -1.0, 7.0]
    dicts[2]["step"] = torch.tensor(5, dtype=torch.int64)
    dicts[1]["exp_avg"] = torch.ones(2)  # a change under another key: still right
    steps[1].set_(torch.tensor(11.0))  # the same tensor on other memory
    assert read(np.array([2, 1, 2], dtype=np.int64)) == [5.0, 11.0, 5.0]
    assert read([3, 0]) == [7.0, 9.0]
    dicts[0]["step"] = torch.ones(1)  # not a 0-dim tensor: the caller reads it its own way
    assert read() is None
    dicts[0] = None
    assert read() == [-1.0, 11.0, 5.0, 7.0]
    with pytest.raises(IndexError):
        cache.scalar_floats(dicts, 0.0, np.array([4], dtype=np.int64))
    with pytest.raises(TypeError):
        cache.scalar_floats(dicts, 0.0, np.array([[0]], dtype=np.int64))


def test_gather_scan_through_dict_values_reads_the_values_a_key_lookup_reads():
    dicts = [{"exp_avg": torch.zeros(3)}, None, {"exp_avg": torch.ones(2)}, {}]
    cache, index = _tensors.DictValues("exp_avg"), np.array([0, 1, 2, 3, 2], dtype=np.int64)

    def same():
        got = _tensors.gather_scan(dicts, index, cache)
        want = _tensors.gather_scan(dicts, index, "exp_avg")
        assert all(a is b for a, b in zip(got[0], want[0]))
        assert all(np.array_equal(a, b) for a, b in zip(got[1:4], want[1:4]))
        assert got[4] == want[4]
        return got[0]

    assert same()[0] is dicts[0]["exp_avg"]
    dicts[0]["exp_avg"] = torch.zeros(3, 2).t()  # rebound to a tensor laid out otherwise
    dicts[3]["exp_avg"] = torch.ones(1)
    dicts[1] = {"exp_avg": torch.zeros(1)}
    picked = same()
    assert picked[0] is dicts[0]["exp_avg"] and picked[1] is dicts[1]["exp_avg"]
    assert picked[3] is dicts[3]["exp_avg"]


def test_grad_scan_reads_gradients_without_python_objects_and_gives_up_on_subclasses():
    params = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(3)]
    params.append(torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))
    params[0].grad = torch.ones(2, 3)
    params[2].grad = torch.ones(3, 2).t()
    params[3].grad = torch.ones(2, dtype=torch.bfloat16)
    at, flags, every, present = _tensors.grad_scan(params)
    assert at.tolist() == [params[0].grad.data_ptr(), 0, params[2].grad.data_ptr(),
                           params[3].grad.data_ptr()]
    assert flags.tolist() == [_tensors.PRESENT | _tensors.CONTIGUOUS | _tensors.DENSE_FLOAT32,
                              0, _tensors.PRESENT | _tensors.DENSE_FLOAT32,
                              _tensors.PRESENT | _tensors.CONTIGUOUS]
    assert (every, present) == (_tensors.PRESENT, 3)  # (the AND of the three present)
    assert _tensors.grad_scan(params[:1])[2:] == (flags[0], 1)
    assert _tensors.grad_scan(params[1:2])[2:] == (0xFF, 0)  # (none present: every bit)
    assert _tensors.grad_scan(params + [torch.zeros(1).as_subclass(Traced)]) is None


def test_grad_sources_give_each_rows_source_in_the_gradients_and_give_up_on_subclasses():
    params = [torch.nn.Parameter(torch.zeros(6)) for _ in range(3)]
    params[0].grad, params[2].grad = torch.ones(6), torch.full((6,), 2.0)
    rows = np.array([0, 2, 2, 1], dtype=np.int64)
    offsets = np.array([0, 4, 12, 8], dtype=np.int64)
    src, every, present = _tensors.grad_sources(params, rows, offsets)
    g0, g2 = params[0].grad.data_ptr(), params[2].grad.data_ptr()
    assert src.tolist() == [g0, g2 + 4, g2 + 12, 0]  # (no gradient: 0)
    assert (every, present) == (_tensors.PRESENT | _tensors.CONTIGUOUS |
                                _tensors.DENSE_FLOAT32, 2)
    params[1].grad = torch.zeros(12)[::2]  # not contiguous
    assert _tensors.grad_sources(params, rows, offsets)[1:] == (_tensors.PRESENT |
                                                                _tensors.DENSE_FLOAT32, 3)
    assert _tensors.grad_sources(params + [torch.zeros(1).as_subclass(Traced)], rows,
                                 offsets) is None
    with pytest.raises(IndexError):
        _tensors.grad_sources(params, np.array([3], dtype=np.int64), offsets[:1])
    with pytest.raises(ValueError):
        _tensors.grad_sources(params, rows, offsets[:2])


def test_same_keys_and_same_params():
    a, b = torch.zeros(1), torch.zeros(1)
    assert _tensors.same_keys([{"x": a, "y": b}, {"x": b, "y": a}]) == ("x", "y")
    assert _tensors.same_keys([{"x": a, "y": b}, {"y": a, "x": b}]) is None  # another order
    assert _tensors.same_keys([{"x": a}, {"x": a, "y": b}]) is None
    assert _tensors.same_keys([{"x": a}, None]) is None and _tensors.same_keys([]) is None
    groups = [{"params": [a, b]}, {"params": [b]}]
    assert _tensors.same_params(groups, ((id(a), id(b)), (id(b),)))
    assert not _tensors.same_params(groups, ((id(b), id(a)), (id(b),)))
    assert not _tensors.same_params(groups, ((id(a), id(b)),))
    # (a tuple of params: Python's fingerprint() decides)
    assert not _tensors.same_params([{"params": (a, b)}], ((id(a), id(b)),))
