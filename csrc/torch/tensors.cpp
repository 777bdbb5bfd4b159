// gockpt._tensors: what the hooks read of thousands of tensors at each step boundary (addresses,
// versions, layouts, gradients, scalar step counters), one C++ pass per list instead of one
// Python call per tensor. The only part of gockpt linked against libtorch (built by setup.py
// with torch's own headers); the core (gockpt._C) stays on raw buffers.
//
// Each function takes a Python list. A tensor of a Python subclass (a DTensor, a tensor with
// __torch_function__) is read through Python, exactly as `tensor.attr` would read it; plain
// tensors and Parameters through their C++ object. None entries are allowed where a function
// says so.
#include <Python.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>

namespace py = pybind11;

namespace {

PyObject* item(const py::list& list, Py_ssize_t i) { return PyList_GET_ITEM(list.ptr(), i); }

const at::Tensor& tensor_at(const py::list& list, Py_ssize_t i) {
  PyObject* o = item(list, i);
  if (!THPVariable_Check(o)) {
    throw py::type_error("gockpt._tensors: item " + std::to_string(i) + " is a " +
                         Py_TYPE(o)->tp_name + ", not a tensor");
  }
  return THPVariable_Unpack(o);
}

// A Python attribute (or method call) of a tensor subclass, as an int64.
int64_t python_int(PyObject* o, const char* name, bool call) {
  py::object attr = py::reinterpret_steal<py::object>(PyObject_GetAttrString(o, name));
  if (!attr) throw py::error_already_set();
  if (call) attr = attr();
  return attr.cast<int64_t>();
}

// Per item: its data_ptr() (0 for None).
py::array_t<int64_t> addresses(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  py::array_t<int64_t> out(n);
  auto a = out.mutable_unchecked<1>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = item(tensors, i);
    if (o == Py_None) {
      a(i) = 0;
    } else if (THPVariable_CheckExact(o)) {
      a(i) = reinterpret_cast<int64_t>(tensor_at(tensors, i).data_ptr());
    } else {
      tensor_at(tensors, i);  // (a tensor, or TypeError)
      a(i) = python_int(o, "data_ptr", true);
    }
  }
  return out;
}

// Flags of scan(): what the hooks check of a tensor before its memory is copied.
constexpr uint8_t kPresent = 1, kContiguous = 2, kDenseFloat32 = 4;

// Per item, in one pass (each tensor's object read once): its data_ptr(), its version counter
// and its flags (kPresent, kContiguous, kDenseFloat32); None: 0, 0, 0.
py::tuple scan(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  py::array_t<int64_t> addr(n), ver(n);
  py::array_t<uint8_t> flags(n);
  auto a = addr.mutable_unchecked<1>();
  auto v = ver.mutable_unchecked<1>();
  auto f = flags.mutable_unchecked<1>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = item(tensors, i);
    if (o == Py_None) {
      a(i) = v(i) = f(i) = 0;
      continue;
    }
    const at::Tensor& t = tensor_at(tensors, i);
    const bool strided = t.layout() == at::kStrided;
    const bool dense_float32 = strided && t.scalar_type() == at::kFloat;
    bool contiguous;
    if (!strided) {  // (sparse: no data pointer; its version still counts writes)
      a(i) = 0;
      v(i) = static_cast<int64_t>(t._version());
      contiguous = false;
    } else if (THPVariable_CheckExact(o)) {
      a(i) = reinterpret_cast<int64_t>(t.data_ptr());
      v(i) = static_cast<int64_t>(t._version());
      contiguous = t.is_contiguous();
    } else {
      a(i) = python_int(o, "data_ptr", true);
      v(i) = python_int(o, "_version", false);
      contiguous = python_int(o, "is_contiguous", true) != 0;
    }
    f(i) = kPresent | (contiguous ? kContiguous : 0) | (dense_float32 ? kDenseFloat32 : 0);
  }
  return py::make_tuple(addr, ver, flags);
}

// Whether each tensor's strides are those of the tuple at the same place of `strides`.
bool strides_match(const py::list& tensors, const py::list& strides) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  if (PyList_GET_SIZE(strides.ptr()) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = item(tensors, i);
    PyObject* planned = item(strides, i);
    if (!PyTuple_Check(planned)) throw py::type_error("strides_match: a stride is not a tuple");
    if (!THPVariable_CheckExact(o)) {  // (a subclass: as Python reads it)
      py::object got = py::reinterpret_borrow<py::object>(o).attr("stride")();
      if (!got.equal(py::reinterpret_borrow<py::object>(planned))) return false;
      continue;
    }
    const at::IntArrayRef got = tensor_at(tensors, i).strides();
    if (static_cast<Py_ssize_t>(got.size()) != PyTuple_GET_SIZE(planned)) return false;
    for (size_t d = 0; d < got.size(); ++d) {
      const long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(planned, d));
      if (want == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (got[d] != want) return false;
    }
  }
  return true;
}

// Per parameter: its .grad (None where it has none).
py::list grads(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = item(params, i);
    PyObject* g;
    if (THPVariable_CheckExact(o)) {
      g = THPVariable_Wrap(tensor_at(params, i).grad());  // (None for an undefined tensor)
    } else {
      tensor_at(params, i);
      g = PyObject_GetAttrString(o, "grad");
      if (!g) throw py::error_already_set();
    }
    PyList_SET_ITEM(out.ptr(), i, g);  // (steals the reference)
  }
  return out;
}

// The values of 0-dim CPU tensors of one dtype as one 1-D tensor of that dtype (their bytes
// copied: exact for every dtype), or None where any is not such a tensor (the caller stacks).
py::object stack_scalars(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  if (n == 0) return py::none();
  const at::ScalarType dtype = tensor_at(tensors, 0).scalar_type();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = item(tensors, i);
    if (!THPVariable_CheckExact(o)) return py::none();
    const at::Tensor& t = tensor_at(tensors, i);
    if (t.dim() != 0 || !t.device().is_cpu() || t.scalar_type() != dtype ||
        t.layout() != at::kStrided || t.is_conj() || t.is_neg()) {
      return py::none();
    }
  }
  at::Tensor out = at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(dtype));
  const size_t size = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * size, tensor_at(tensors, i).const_data_ptr(), size);
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
}

// Per dict (None allowed): dict.get(key).
py::list values(const py::list& dicts, const py::object& key) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts.ptr());
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = item(dicts, i);
    PyObject* v = Py_None;
    if (d != Py_None) {
      if (!PyDict_Check(d)) {
        throw py::type_error(std::string("gockpt._tensors.values: item is a ") +
                             Py_TYPE(d)->tp_name + ", not a dict");
      }
      v = PyDict_GetItemWithError(d, key.ptr());  // (borrowed)
      if (!v) {
        if (PyErr_Occurred()) throw py::error_already_set();
        v = Py_None;
      }
    }
    Py_INCREF(v);
    PyList_SET_ITEM(out.ptr(), i, v);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_tensors, m) {
  m.doc() = "What gockpt's hooks read of many tensors, one C++ pass per list";
  m.def("addresses", &addresses, py::arg("tensors"),
        "Per item: tensor.data_ptr() as an int64 array (0 for None).");
  m.def("scan", &scan, py::arg("tensors"),
        "Per item, in one pass: (data_ptr int64 array, _version int64 array, flags uint8 array: "
        "PRESENT | CONTIGUOUS | DENSE_FLOAT32); None: 0, 0, 0.");
  m.attr("PRESENT") = kPresent;
  m.attr("CONTIGUOUS") = kContiguous;
  m.attr("DENSE_FLOAT32") = kDenseFloat32;
  m.def("strides_match", &strides_match, py::arg("tensors"), py::arg("strides"),
        "Whether tensors[i].stride() == strides[i] for every i (same lengths).");
  m.def("grads", &grads, py::arg("params"), "Per parameter: its .grad (None where none).");
  m.def("stack_scalars", &stack_scalars, py::arg("tensors"),
        "0-dim CPU tensors of one dtype as one 1-D tensor of it (bytes copied), or None.");
  m.def("values", &values, py::arg("dicts"), py::arg("key"),
        "Per dict (None allowed): dict.get(key).");
}
