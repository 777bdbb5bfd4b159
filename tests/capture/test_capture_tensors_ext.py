"""gockpt._tensors (the hooks' reads of many tensors in one C++ pass) reads what Python reads:
plain tensors, Parameters, tensor subclasses (through Python), None, sparse and strided views."""

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
