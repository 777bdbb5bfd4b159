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
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

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

// Whether tensors[i] (a tensor) has the strides `planned` (a tuple); a subclass as Python
// reads them.
bool has_strides(const py::list& tensors, Py_ssize_t i, PyObject* planned) {
  PyObject* o = item(tensors, i);
  if (!PyTuple_Check(planned)) throw py::type_error("strides: a stride is not a tuple");
  if (!THPVariable_CheckExact(o)) {  // (a subclass: as Python reads it)
    py::object got = py::reinterpret_borrow<py::object>(o).attr("stride")();
    return got.equal(py::reinterpret_borrow<py::object>(planned));
  }
  const at::IntArrayRef got = tensor_at(tensors, i).strides();
  if (static_cast<Py_ssize_t>(got.size()) != PyTuple_GET_SIZE(planned)) return false;
  for (size_t d = 0; d < got.size(); ++d) {
    const long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(planned, d));
    if (want == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (got[d] != want) return false;
  }
  return true;
}

// Whether each tensor's strides are those of the tuple at the same place of `strides`.
bool strides_match(const py::list& tensors, const py::list& strides) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  if (PyList_GET_SIZE(strides.ptr()) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!has_strides(tensors, i, item(strides, i))) return false;
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
  if (n == 0 || !THPVariable_CheckExact(item(tensors, 0))) return py::none();
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


// A 0-dim CPU tensor's value as a float64 into *out; false where `v` is not a plain 0-dim
// CPU tensor of float32, float64, int64 or int32.
bool scalar_value(PyObject* v, double* out) {
  if (!THPVariable_CheckExact(v)) return false;
  const at::Tensor& t = THPVariable_Unpack(v);
  if (t.dim() != 0 || !t.device().is_cpu() || t.layout() != at::kStrided || t.is_conj() ||
      t.is_neg()) {
    return false;
  }
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kFloat: *out = *static_cast<const float*>(p); return true;
    case at::kDouble: *out = *static_cast<const double*>(p); return true;
    case at::kLong: *out = static_cast<double>(*static_cast<const int64_t*>(p)); return true;
    case at::kInt: *out = *static_cast<const int32_t*>(p); return true;
    default: return false;
  }
}

// dict.get(key) as a borrowed reference, nullptr where the key is missing.
PyObject* dict_get(PyObject* d, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(d, key);  // (borrowed)
  if (!v && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// The scalar_floats() pass, `get(position, dict)` giving that dict's value (borrowed, or
// nullptr: missing).
template <typename Get>
py::object scalar_floats_with(const py::list& dicts, double missing, const py::object& index,
                              Get get) {
  // `index`: None, a list of ints, or a 1-D int64 array (read without an int object each)
  const bool indexed = !index.is_none();
  const bool listed = indexed && PyList_Check(index.ptr());
  py::array_t<int64_t> positions;
  if (indexed && !listed) {
    if (!py::isinstance<py::array_t<int64_t>>(index) ||
        py::reinterpret_borrow<py::array>(index).ndim() != 1) {
      throw py::type_error("scalar_floats: index is not a list or a 1-D int64 array");
    }
    positions = py::reinterpret_borrow<py::array_t<int64_t>>(index);
  }
  const Py_ssize_t size = PyList_GET_SIZE(dicts.ptr());
  const Py_ssize_t n = !indexed ? size : listed ? PyList_GET_SIZE(index.ptr())
                                                : static_cast<Py_ssize_t>(positions.shape(0));
  py::array_t<double> out(n);
  auto a = out.mutable_unchecked<1>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_ssize_t at = i;
    if (listed) {
      at = PyNumber_AsSsize_t(PyList_GET_ITEM(index.ptr(), i), PyExc_IndexError);
      if (at == -1 && PyErr_Occurred()) throw py::error_already_set();
    } else if (indexed) {
      at = static_cast<Py_ssize_t>(positions.at(i));
    }
    if (at < 0 || at >= size) throw py::index_error("scalar_floats: index out of range");
    PyObject* d = item(dicts, at);
    a(i) = missing;
    if (d == Py_None) continue;
    if (!PyDict_Check(d)) return py::none();
    PyObject* v = get(at, d);
    if (v && !scalar_value(v, &a(i))) return py::none();
  }
  return std::move(out);
}

// Per dict (None allowed; with `index`, a list of positions: per dicts[index[i]]):
// dict.get(key) as a float64, `missing` where the dict is None or lacks the key; None when a
// value present is not a 0-dim CPU tensor of float32, float64, int64 or int32 (the caller
// reads those its own way). One pass: Adam's step counters without a Python object per value.
py::object scalar_floats(const py::list& dicts, const py::object& key, double missing,
                         const py::object& index) {
  return scalar_floats_with(dicts, missing, index,
                            [&](Py_ssize_t, PyObject* d) { return dict_get(d, key.ptr()); });
}

// Whether this CPython gives every dict a version tag that each change of the dict replaces
// by a new, globally unique one (PEP 509; up to 3.11: later versions keep the field for dict
// watchers and no longer promise it).
#if PY_VERSION_HEX < 0x030C0000
#define GOCKPT_DICT_VERSIONS 1
uint64_t dict_version(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#else
#define GOCKPT_DICT_VERSIONS 0
uint64_t dict_version(PyObject*) { return 0; }
#endif

// Whether some dicts are the very dicts of the last call, none of them changed since (by
// dict_version): what was read from them then may be used again. Without dict versions,
// never.
class DictVersions {
 public:
  // `dicts`: a list of dicts; notes them (and their versions) for the next call.
  bool same(const py::list& dicts) {
    const Py_ssize_t n = PyList_GET_SIZE(dicts.ptr());
    bool same = GOCKPT_DICT_VERSIONS && static_cast<Py_ssize_t>(seen_.size()) == n;
    for (Py_ssize_t i = 0; same && i < n; ++i) {
      PyObject* d = item(dicts, i);
      same = d == seen_[i].first.ptr() && dict_version(d) == seen_[i].second;
    }
    if (same) return true;
    seen_.clear();
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* d = item(dicts, i);
      if (!PyDict_Check(d)) throw py::type_error("DictVersions.same: an item is not a dict");
      seen_.emplace_back(py::reinterpret_borrow<py::object>(d), dict_version(d));
    }
    return false;
  }

 private:
  std::vector<std::pair<py::object, uint64_t>> seen_;
};

// What a dict holds under one key, looked up again only where the dict has changed since:
// CPython up to 3.11 gives every dict a version tag that any change of it replaces by a new,
// globally unique one (PEP 509), so an unchanged tag on the same dict object (kept alive
// here) means the same value object. A hit reads no dict, only the value (a step counter's
// lookup was two thirds of its read after a training step). Later CPythons (where the tag
// no longer changes with every change) look every key up.
class DictValues {
 public:
  explicit DictValues(py::object key) : key_(std::move(key)) {}

  // The value of dicts[at] (a dict), borrowed; nullptr where the key is missing.
  PyObject* get(Py_ssize_t at, PyObject* d) {
#if GOCKPT_DICT_VERSIONS
    if (static_cast<size_t>(at) >= seen_.size()) seen_.resize(at + 1);
    Seen& s = seen_[at];
    const uint64_t version = dict_version(d);
    if (s.dict.ptr() == d && s.version == version) return s.value.ptr();
    PyObject* v = dict_get(d, key_.ptr());
    s.dict = py::reinterpret_borrow<py::object>(d);
    s.version = version;
    s.value = py::reinterpret_borrow<py::object>(v);  // (null where missing)
    return v;
#else
    (void)at;
    return dict_get(d, key_.ptr());
#endif
  }

  py::object scalar_floats(const py::list& dicts, double missing, const py::object& index) {
    return scalar_floats_with(dicts, missing, index,
                              [&](Py_ssize_t at, PyObject* d) { return get(at, d); });
  }

 private:
  struct Seen {
    py::object dict, value;
    uint64_t version = 0;
  };
  py::object key_;
  std::vector<Seen> seen_;
};

// The data_ptr() and the scan() flags of params[i].grad into *at / *flags (0, 0 where it has
// none), read without a Python object for the gradient; false where the parameter or its
// gradient is a tensor subclass (the caller reads those through Python).
bool read_grad(const py::list& params, Py_ssize_t i, int64_t* at, uint8_t* flags) {
  if (!THPVariable_CheckExact(item(params, i))) return false;
  const at::Tensor& g = tensor_at(params, i).grad();
  if (!g.defined()) {
    *at = *flags = 0;
    return true;
  }
  if (g.unsafeGetTensorImpl()->is_python_dispatch()) return false;  // (a subclass)
  const bool strided = g.layout() == at::kStrided;
  *at = strided ? reinterpret_cast<int64_t>(g.data_ptr()) : 0;
  *flags = kPresent | (strided && g.is_contiguous() ? kContiguous : 0) |
           (strided && g.scalar_type() == at::kFloat ? kDenseFloat32 : 0);
  return true;
}

// Per parameter: the data_ptr() and the flags of scan() of its .grad (0, 0 where it has
// none), read in C++ without a Python object for the gradient, with the AND of the flags of
// the gradients present (all bits set when none is) and how many are present; None when some
// parameter is a tensor subclass (the caller reads those through Python).
py::object grad_scan(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  py::array_t<int64_t> addr(n);
  py::array_t<uint8_t> flags(n);
  auto a = addr.mutable_unchecked<1>();
  auto f = flags.mutable_unchecked<1>();
  uint8_t every = 0xff;
  Py_ssize_t present = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!read_grad(params, i, &a(i), &f(i))) return py::none();
    if (f(i)) {
      every &= f(i);
      ++present;
    }
  }
  return py::make_tuple(addr, flags, every, present);
}

// The sources of memcpy segments reading the parameters' gradients, in one pass without a
// Python object per gradient: row r reads the gradient of params[rows[r]] from `offsets[r]`
// bytes past its start. Returns (the sources, the AND of the scan() flags of the gradients
// present -- all bits set when none is --, how many parameters have one); a row whose
// parameter has no gradient reads 0. None when some parameter, or gradient, is a tensor
// subclass (the caller reads those through Python).
py::object grad_sources(const py::list& params, const py::array_t<int64_t>& rows,
                        const py::array_t<int64_t>& offsets) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  auto r = rows.unchecked<1>();
  auto o = offsets.unchecked<1>();
  if (r.shape(0) != o.shape(0)) throw py::value_error("grad_sources: rows and offsets differ");
  std::vector<int64_t> at(static_cast<size_t>(n));
  uint8_t every = 0xff;
  Py_ssize_t present = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint8_t flags;
    if (!read_grad(params, i, &at[i], &flags)) return py::none();
    if (flags) {
      every &= flags;
      ++present;
    }
  }
  py::array_t<int64_t> src(r.shape(0));
  auto out = src.mutable_unchecked<1>();
  for (py::ssize_t k = 0; k < r.shape(0); ++k) {
    const int64_t i = r(k);
    if (i < 0 || i >= n) throw py::index_error("grad_sources: row out of range");
    out(k) = at[i] ? at[i] + o(k) : 0;
  }
  return py::make_tuple(src, every, present);
}

// scan() of the tensors at positions `index` of `items`: the items themselves (key None), or
// each item's dict.get(key) (an item None or without the key: None; `key` a DictValues: its
// key, a dict unchanged since that object last read it not looked up again). Returns (those
// tensors as a list, their addresses, versions and flags as scan() gives them, and the flags
// every tensor present has: the AND of theirs, all bits set when none is). One pass, no list
// of the items picked or of the values read built in Python.
py::tuple gather_scan(const py::list& items, const py::array_t<int64_t>& index,
                      const py::object& key) {
  auto idx = index.unchecked<1>();
  const Py_ssize_t n = idx.shape(0), size = PyList_GET_SIZE(items.ptr());
  const bool by_key = !key.is_none();
  DictValues* cached = by_key && py::isinstance<DictValues>(key) ? key.cast<DictValues*>()
                                                                 : nullptr;
  py::list picked(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t at = idx(i);
    if (at < 0 || at >= size) throw py::index_error("gather_scan: index out of range");
    PyObject* o = item(items, at);
    if (by_key && o != Py_None) {
      if (!PyDict_Check(o)) {
        throw py::type_error(std::string("gockpt._tensors.gather_scan: item is a ") +
                             Py_TYPE(o)->tp_name + ", not a dict");
      }
      PyObject* v = cached ? cached->get(at, o) : dict_get(o, key.ptr());  // (borrowed)
      o = v ? v : Py_None;
    }
    Py_INCREF(o);
    PyList_SET_ITEM(picked.ptr(), i, o);
  }
  py::tuple scanned = scan(picked);
  auto f = scanned[2].cast<py::array_t<uint8_t>>().unchecked<1>();
  uint8_t every = 0xff;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (f(i)) every &= f(i);
  }
  return py::make_tuple(picked, scanned[0], scanned[1], scanned[2], every);
}

// Whether each tensor of `picked` (None: skipped), read for position index[i] of a list,
// has the strides strides[index[i]] (a tuple): the check of a planned layout made in the
// pass that reads the tensors anyway.
bool picked_strides_match(const py::list& picked, const py::array_t<int64_t>& index,
                          const py::list& strides) {
  auto idx = index.unchecked<1>();
  const Py_ssize_t n = PyList_GET_SIZE(picked.ptr()), size = PyList_GET_SIZE(strides.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (item(picked, i) == Py_None) continue;
    const int64_t at = idx(i);
    if (at < 0 || at >= size) throw py::index_error("segment_sources: strides out of range");
    if (!has_strides(picked, i, item(strides, at))) return false;
  }
  return true;
}

// The sources of a group's memcpy segments, every role in one call: `roles` is a list of
// (items, index, key, at, offset[, strides]), each read as gather_scan(items, index, key)
// reads it, and each of its rows r copies from the address of its tensor at[r] plus
// offset[r] bytes, or from `zero` where that tensor is absent (no such optimizer state yet);
// `strides` (a list of tuples, per position in `items`; None: not checked) the strides each
// tensor read must have. Returns (the sources of every role's rows in order, as one int64
// array; per role (tensors, addresses, versions, flags); the AND of the flags of every tensor
// present; the rows copying zeros; whether every tensor checked has its strides).
py::tuple segment_sources(const py::list& roles, int64_t zero) {
  const Py_ssize_t n_roles = PyList_GET_SIZE(roles.ptr());
  using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  std::vector<py::tuple> specs;
  std::vector<I64> ats, offsets;  // (cast once: what sizes the result is what is read)
  Py_ssize_t rows = 0;
  for (Py_ssize_t r = 0; r < n_roles; ++r) {
    PyObject* o = item(roles, r);
    if (!PyTuple_Check(o) || (PyTuple_GET_SIZE(o) != 5 && PyTuple_GET_SIZE(o) != 6)) {
      throw py::type_error("segment_sources: a role is not a tuple of 5 or 6 items");
    }
    py::tuple spec = py::reinterpret_borrow<py::tuple>(o);
    ats.push_back(spec[3].cast<I64>());
    offsets.push_back(spec[4].cast<I64>());
    rows += ats.back().shape(0);
    specs.push_back(spec);
  }
  py::array_t<int64_t> src(rows);
  int64_t* out = src.mutable_data();
  py::list scans(n_roles);
  uint8_t every = 0xff;
  int64_t zeros = 0;
  bool strides_ok = true;
  for (Py_ssize_t r = 0; r < n_roles; ++r) {
    const py::tuple& spec = specs[r];
    const py::array_t<int64_t> index = spec[1].cast<py::array_t<int64_t>>();
    py::tuple scanned = gather_scan(spec[0].cast<py::list>(), index, spec[2]);
    if (spec.size() == 6 && !spec[5].is_none() && strides_ok) {
      strides_ok = picked_strides_match(scanned[0].cast<py::list>(), index,
                                        spec[5].cast<py::list>());
    }
    every &= scanned[4].cast<uint8_t>();
    const I64& at = ats[r];
    const I64& offset = offsets[r];
    const py::array_t<int64_t> addresses = scanned[1].cast<py::array_t<int64_t>>();
    const auto addr = addresses.unchecked<1>();
    const Py_ssize_t m = at.shape(0), n_tensors = addr.shape(0);
    if (offset.shape(0) != m) throw py::value_error("segment_sources: at and offset differ");
    for (Py_ssize_t i = 0; i < m; ++i) {
      const int64_t t = at.data()[i];
      if (t < 0 || t >= n_tensors) throw py::index_error("segment_sources: at out of range");
      const int64_t base = addr(t);
      if (base == 0) ++zeros;
      *out++ = base == 0 ? zero : base + offset.data()[i];
    }
    PyList_SET_ITEM(scans.ptr(), r, py::make_tuple(scanned[0], scanned[1], scanned[2],
                                                   scanned[3]).release().ptr());
  }
  return py::make_tuple(src, scans, every, zeros, strides_ok);
}

// The positions of the tensors of `tensors` (None allowed) whose address or version is no
// longer the one in `addresses` / `versions` (a scan() taken earlier), in one pass.
std::vector<int64_t> moved_positions(const py::list& tensors, const py::array_t<int64_t>& addresses,
                                     const py::array_t<int64_t>& versions) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  auto a = addresses.unchecked<1>();
  auto v = versions.unchecked<1>();
  if (a.shape(0) != n || v.shape(0) != n) throw py::value_error("moved: lengths differ");
  std::vector<int64_t> out;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = item(tensors, i);
    int64_t at = 0, version = 0;
    if (o != Py_None) {
      const at::Tensor& t = tensor_at(tensors, i);
      if (!THPVariable_CheckExact(o)) {
        at = t.layout() == at::kStrided ? python_int(o, "data_ptr", true) : 0;
        version = python_int(o, "_version", false);
      } else {
        at = t.layout() == at::kStrided ? reinterpret_cast<int64_t>(t.data_ptr()) : 0;
        version = static_cast<int64_t>(t._version());
      }
    }
    if (at != a(i) || version != v(i)) out.push_back(i);
  }
  return out;
}

py::array_t<int64_t> moved(const py::list& tensors, const py::array_t<int64_t>& addresses,
                           const py::array_t<int64_t>& versions) {
  const std::vector<int64_t> out = moved_positions(tensors, addresses, versions);
  py::array_t<int64_t> result(static_cast<py::ssize_t>(out.size()));
  if (!out.empty()) std::memcpy(result.mutable_data(), out.data(), out.size() * sizeof(int64_t));
  return result;
}

// moved() of several columns in one call: `columns` a list of (labels, tensors, addresses,
// versions); returns the labels (labels[i], any sequence) of every tensor written or moved.
py::list moved_labels(const py::list& columns) {
  py::list out;
  for (Py_ssize_t c = 0; c < PyList_GET_SIZE(columns.ptr()); ++c) {
    PyObject* o = item(columns, c);
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 4) {
      throw py::type_error("moved_labels: a column is not a tuple of 4 items");
    }
    py::tuple column = py::reinterpret_borrow<py::tuple>(o);
    for (const int64_t i : moved_positions(column[1].cast<py::list>(),
                                           column[2].cast<py::array_t<int64_t>>(),
                                           column[3].cast<py::array_t<int64_t>>())) {
      PyObject* label = PySequence_GetItem(column[0].ptr(), static_cast<Py_ssize_t>(i));
      if (!label) throw py::error_already_set();
      PyObject* index = PyNumber_Index(label);  // (a numpy integer as a Python int)
      Py_DECREF(label);
      if (!index) throw py::error_already_set();
      const int appended = PyList_Append(out.ptr(), index);
      Py_DECREF(index);
      if (appended < 0) throw py::error_already_set();
    }
  }
  return out;
}

// Whether the param groups `groups` (dicts) hold under "params" the very objects whose id()s
// `planned` lists, group by group and in order (a tuple of tuples of ints): an optimizer
// whose parameters are the planned ones, checked without an int object per parameter.
bool same_params(const py::list& groups, const py::tuple& planned) {
  const Py_ssize_t n = PyList_GET_SIZE(groups.ptr());
  if (PyTuple_GET_SIZE(planned.ptr()) != n) return false;
  py::str params_key("params");
  for (Py_ssize_t gi = 0; gi < n; ++gi) {
    PyObject* g = item(groups, gi);
    PyObject* ids = PyTuple_GET_ITEM(planned.ptr(), gi);
    if (!PyDict_Check(g) || !PyTuple_Check(ids)) return false;
    PyObject* params = PyDict_GetItemWithError(g, params_key.ptr());  // (borrowed)
    if (!params) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return false;
    }
    if (!PyList_Check(params) || PyList_GET_SIZE(params) != PyTuple_GET_SIZE(ids)) return false;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); ++i) {
      void* want = PyLong_AsVoidPtr(PyTuple_GET_ITEM(ids, i));
      if (!want && PyErr_Occurred()) throw py::error_already_set();
      if (PyList_GET_ITEM(params, i) != want) return false;
    }
  }
  return true;
}

// Whether every item of `dicts` is a dict with the very keys of the first, in its order: that
// first dict's keys as a tuple, or None (also for an empty list, or an item that is no dict).
py::object same_keys(const py::list& dicts) {
  const Py_ssize_t n = PyList_GET_SIZE(dicts.ptr());
  if (n == 0 || !PyDict_Check(item(dicts, 0))) return py::none();
  PyObject* first = item(dicts, 0);
  const Py_ssize_t size = PyDict_GET_SIZE(first);
  py::tuple keys(size);
  {
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    while (PyDict_Next(first, &pos, &key, &value)) {
      Py_INCREF(key);
      PyTuple_SET_ITEM(keys.ptr(), k++, key);
    }
  }
  for (Py_ssize_t i = 1; i < n; ++i) {
    PyObject* d = item(dicts, i);
    if (!PyDict_Check(d) || PyDict_GET_SIZE(d) != size) return py::none();
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
      PyObject* want = PyTuple_GET_ITEM(keys.ptr(), k++);
      if (key == want) continue;
      const int eq = PyObject_RichCompareBool(key, want, Py_EQ);
      if (eq < 0) throw py::error_already_set();
      if (!eq) return py::none();
    }
  }
  return std::move(keys);
}

// What one walk read, to tell whether a walk now would read the same (see ModuleWalkCache).
struct WalkReads {
  std::vector<std::pair<py::object, uint64_t>> dicts;         // each dict read, its version
  std::vector<std::pair<py::object, PyTypeObject*>> modules;  // each module, its type
  std::vector<std::pair<py::object, py::object>> sets;        // each set read, a frozen copy
  bool complete = true;  // false: something was read that has no version (not kept)

  void dict(PyObject* d) {
    dicts.emplace_back(py::reinterpret_borrow<py::object>(d), dict_version(d));
  }
};

// The walk of module_entries(): appends (name, value) to `out` in state_dict()'s order;
// false when state_dict() itself must be asked (see module_entries).
struct ModuleWalk {
  PyObject* planned;       // dict keyed by id() of the tensors left out
  PyObject* plain_types;   // type -> bool: whether state_dict() of the type is nn.Module's own
  PyObject* wrapped;       // tuple of child names that are always a wrapper's inner module
  PyObject* module_owner;  // tuple of types whose child "module" is the wrapped one
  PyObject* out;           // list
  py::object unknown;      // the first type not in plain_types (the caller classifies it)
  WalkReads* reads = nullptr;  // where what is read is noted (none: not noted)
  py::object n_params = py::str("_parameters"), n_buffers = py::str("_buffers"),
             n_modules = py::str("_modules"), n_transient = py::str("_non_persistent_buffers_set"),
             n_hooks = py::str("_state_dict_hooks"), n_pre_hooks = py::str("_state_dict_pre_hooks"),
             n_module = py::str("module"), dot = py::str(".");

  // The module's attribute: from its instance dict where it is there (nn.Module keeps these
  // there: no type lookup, no __getattr__ hook), else as Python reads it.
  py::object attr(PyObject* m, const py::object& name) {
    PyObject** dict = _PyObject_GetDictPtr(m);
    if (dict && *dict) {
      PyObject* a = PyDict_GetItemWithError(*dict, name.ptr());  // (borrowed)
      if (a) return py::reinterpret_borrow<py::object>(a);
      if (PyErr_Occurred()) throw py::error_already_set();
    }
    if (reads) reads->complete = false;  // (a class attribute or __getattr__: no version)
    PyObject* a = PyObject_GetAttr(m, name.ptr());
    if (!a) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(a);
  }

  bool walk(PyObject* m, const py::object& prefix) {
    if (reads) {
      reads->modules.emplace_back(py::reinterpret_borrow<py::object>(m), Py_TYPE(m));
      PyObject** own = _PyObject_GetDictPtr(m);
      if (own && *own) reads->dict(*own);
    }
    PyObject* plain = PyDict_GetItemWithError(plain_types, reinterpret_cast<PyObject*>(Py_TYPE(m)));
    if (!plain) {
      if (PyErr_Occurred()) throw py::error_already_set();
      unknown = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(m)));
      return false;
    }
    if (plain != Py_True) return false;
    for (const py::object* hooks : {&n_hooks, &n_pre_hooks}) {
      py::object found = attr(m, *hooks);
      note(found.ptr(), false);  // (only whether there is any)
      const int any = PyObject_IsTrue(found.ptr());
      if (any < 0) throw py::error_already_set();
      if (any) return false;
    }
    py::object params = attr(m, n_params), buffers = attr(m, n_buffers);
    if (!PyDict_Check(params.ptr()) || !PyDict_Check(buffers.ptr())) return false;
    note(params.ptr());
    note(buffers.ptr());
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(params.ptr(), &pos, &name, &value)) {
      if (value == Py_None) continue;
      py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(value));
      const int left_out = PyDict_Contains(planned, id.ptr());
      if (left_out < 0) throw py::error_already_set();
      if (!left_out) append(prefix, name, value);
    }
    if (PyDict_GET_SIZE(buffers.ptr())) {
      py::object transient = attr(m, n_transient);
      note(transient.ptr());
      pos = 0;
      while (PyDict_Next(buffers.ptr(), &pos, &name, &value)) {
        if (value == Py_None) continue;
        const int skip = PySequence_Contains(transient.ptr(), name);
        if (skip < 0) throw py::error_already_set();
        if (!skip) append(prefix, name, value);
      }
    }
    py::object children = attr(m, n_modules);
    if (!PyDict_Check(children.ptr())) return false;
    note(children.ptr());
    pos = 0;
    while (PyDict_Next(children.ptr(), &pos, &name, &value)) {
      if (value == Py_None) continue;
      int inner = PySequence_Contains(wrapped, name);
      if (inner < 0) throw py::error_already_set();
      if (!inner && PyUnicode_Compare(name, n_module.ptr()) == 0) {
        inner = PyObject_IsInstance(m, module_owner);
        if (inner < 0) throw py::error_already_set();
      }
      py::object child_prefix = prefix;
      if (!inner) {
        child_prefix = py::reinterpret_steal<py::object>(PyUnicode_Concat(prefix.ptr(), name));
        if (!child_prefix) throw py::error_already_set();
        child_prefix = py::reinterpret_steal<py::object>(
            PyUnicode_Concat(child_prefix.ptr(), dot.ptr()));
        if (!child_prefix) throw py::error_already_set();
      }
      py::object child = py::reinterpret_borrow<py::object>(value);  // (the dict may change)
      if (!walk(child.ptr(), child_prefix)) return false;
    }
    return true;
  }

  // Note what was read: a dict by its version (a dict whose order is read: a plain dict, as
  // a subclass may reorder itself without a new version), a set by a frozen copy; anything
  // else makes the walk one that is not kept.
  void note(PyObject* o, bool ordered = true) {
    if (!reads) return;
    if (ordered ? PyDict_CheckExact(o) : PyDict_Check(o)) {
      reads->dict(o);
    } else if (PyAnySet_CheckExact(o)) {
      PyObject* frozen = PyFrozenSet_New(o);
      if (!frozen) throw py::error_already_set();
      reads->sets.emplace_back(py::reinterpret_borrow<py::object>(o),
                               py::reinterpret_steal<py::object>(frozen));
    } else {
      reads->complete = false;
    }
  }

  void append(const py::object& prefix, PyObject* name, PyObject* value) {
    py::object full = py::reinterpret_steal<py::object>(PyUnicode_Concat(prefix.ptr(), name));
    if (!full) throw py::error_already_set();
    py::tuple entry = py::make_tuple(full, py::reinterpret_borrow<py::object>(value));
    if (PyList_Append(out, entry.ptr()) < 0) throw py::error_already_set();
  }
};

// (name, value) of what `model.state_dict(keep_vars=True)` holds outside `planned` (a dict
// keyed by id()), in its order, with the names of wrapped children left out (`wrapped`; the
// child "module" of an instance of `module_owner`), read from the modules' own dicts in one
// C++ walk. None when state_dict() itself must be asked (a module whose type is marked False
// in `plain_types`, or that has state_dict hooks); the first type missing from `plain_types`
// when it must be classified first.
py::object module_entries(const py::object& model, const py::dict& planned,
                          const py::dict& plain_types, const py::tuple& wrapped,
                          const py::tuple& module_owner) {
  py::list out;
  ModuleWalk w{planned.ptr(), plain_types.ptr(), wrapped.ptr(), module_owner.ptr(), out.ptr(),
               py::none()};
  if (w.walk(model.ptr(), py::str(""))) return std::move(out);
  return w.unknown;
}

// module_entries() of one model, walked again only when something the last walk read has
// changed: every dict it read (the modules' own, their parameters, buffers, children and
// state_dict hooks, the planned ids, the classes' table) has the same version (see
// dict_version), every module the same class, every set of non-persistent buffer names the
// same names. Then the walk would read the very same objects: its (name, value) list is
// returned again (a new list of the same pairs). A model walked once at F stays about as
// costly to check as the number of its modules, without reading a parameter or a name.
// Without dict versions (CPython 3.12 on), or where the walk read anything else, every call
// walks.
class ModuleWalkCache {
 public:
  py::object entries(const py::object& model, const py::dict& planned,
                     const py::dict& plain_types, const py::tuple& wrapped,
                     const py::tuple& module_owner) {
    if (kept_ && unchanged(model, planned, plain_types, wrapped, module_owner)) {
      ++hits_;
      return py::reinterpret_steal<py::object>(PyList_GetSlice(out_.ptr(), 0, PY_SSIZE_T_MAX));
    }
    kept_ = false;
    auto reads = std::make_unique<WalkReads>();
    reads->dict(planned.ptr());
    reads->dict(plain_types.ptr());
    py::list out;
    ModuleWalk w{planned.ptr(), plain_types.ptr(), wrapped.ptr(), module_owner.ptr(),
                 out.ptr(), py::none(), reads.get()};
    if (!w.walk(model.ptr(), py::str(""))) return w.unknown;
    if (GOCKPT_DICT_VERSIONS && reads->complete) {
      reads_ = std::move(reads);
      model_ = model;
      wrapped_ = wrapped;
      module_owner_ = module_owner;
      out_ = py::reinterpret_steal<py::object>(PyList_GetSlice(out.ptr(), 0, PY_SSIZE_T_MAX));
      kept_ = true;
    }
    return std::move(out);
  }

  int64_t hits() const { return hits_; }

 private:
  bool unchanged(const py::object& model, const py::dict& planned, const py::dict& plain_types,
                 const py::tuple& wrapped, const py::tuple& module_owner) const {
    if (model.ptr() != model_.ptr() || wrapped.ptr() != wrapped_.ptr() ||
        module_owner.ptr() != module_owner_.ptr()) {
      return false;
    }
    const auto& dicts = reads_->dicts;  // (planned and plain_types first: compared as read)
    if (dicts.size() < 2 || dicts[0].first.ptr() != planned.ptr() ||
        dicts[1].first.ptr() != plain_types.ptr()) {
      return false;
    }
    for (const auto& [d, version] : dicts) {
      if (dict_version(d.ptr()) != version) return false;
    }
    for (const auto& [m, type] : reads_->modules) {
      if (Py_TYPE(m.ptr()) != type) return false;
    }
    for (const auto& [set, frozen] : reads_->sets) {
      const int same = PyObject_RichCompareBool(set.ptr(), frozen.ptr(), Py_EQ);
      if (same < 0) throw py::error_already_set();
      if (!same) return false;
    }
    return true;
  }

  bool kept_ = false;
  std::unique_ptr<WalkReads> reads_;
  py::object model_, wrapped_, module_owner_, out_;
  int64_t hits_ = 0;
};

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
  m.def("scalar_floats", &scalar_floats, py::arg("dicts"), py::arg("key"), py::arg("missing"),
        py::arg("index") = py::none(),
        "Per dict (or per dicts[i] for i in the list `index`): dict.get(key) of a 0-dim CPU "
        "tensor as float64 (`missing`: none), or None.");
  py::class_<DictValues>(m, "DictValues",
                         "What dicts hold under one key, looked up again only where a dict "
                         "changed since the last read (CPython <= 3.11; later: every read).")
      .def(py::init<py::object>(), py::arg("key"))
      .def("scalar_floats", &DictValues::scalar_floats, py::arg("dicts"), py::arg("missing"),
           py::arg("index") = py::none(),
           "scalar_floats(dicts, key, missing, index) with this object's key.");
  py::class_<DictVersions>(m, "DictVersions",
                           "Whether a list of dicts holds the very dicts of the last call, "
                           "none changed since (CPython <= 3.11; later: never).")
      .def(py::init<>())
      .def("same", &DictVersions::same, py::arg("dicts"),
           "Whether `dicts` are the dicts of the last call, unchanged; notes them.");
  m.def("grad_scan", &grad_scan, py::arg("params"),
        "Per parameter: (data_ptr, scan flags) of its .grad without wrapping it, then the AND of "
        "the flags present and how many are; or None.");
  m.def("grad_sources", &grad_sources, py::arg("params"), py::arg("rows"), py::arg("offsets"),
        "Sources of segments reading params[rows[r]].grad from offsets[r] bytes, in one pass: "
        "(sources, the AND of the gradients' scan flags, how many are present), or None.");
  m.def("gather_scan", &gather_scan, py::arg("items"), py::arg("index"), py::arg("key"),
        "scan() of items[index] (key None) or of items[index].get(key): (tensors, addresses, "
        "versions, flags, the AND of the flags present).");
  m.def("segment_sources", &segment_sources, py::arg("roles"), py::arg("zero"),
        "Sources of a group's memcpy segments, per role (items, index, key, at, offset[, "
        "strides]): (sources, per role (tensors, addresses, versions, flags), AND of the flags "
        "present, rows copying zeros, whether every tensor checked has its planned strides).");
  m.def("moved_labels", &moved_labels, py::arg("columns"),
        "moved() of columns (labels, tensors, addresses, versions) in one call: the labels of "
        "the tensors written or moved, as ints.");
  m.def("moved", &moved, py::arg("tensors"), py::arg("addresses"), py::arg("versions"),
        "Positions whose data_ptr or _version differ from those of an earlier scan().");
  m.def("same_params", &same_params, py::arg("groups"), py::arg("planned"),
        "Whether each param group's 'params' list holds the objects of the ids planned.");
  m.def("same_keys", &same_keys, py::arg("dicts"),
        "The keys of dicts[0] as a tuple when every dict has them, in that order; else None.");
  py::class_<ModuleWalkCache>(m, "ModuleWalkCache",
                              "module_entries() of one model, walked again only when something "
                              "the last walk read has changed (CPython <= 3.11; later: every "
                              "call walks).")
      .def(py::init<>())
      .def("entries", &ModuleWalkCache::entries, py::arg("model"), py::arg("planned"),
           py::arg("plain_types"), py::arg("wrapped"), py::arg("module_owner"),
           "module_entries(model, planned, plain_types, wrapped, module_owner).")
      .def_property_readonly("hits", &ModuleWalkCache::hits,
                             "Calls answered without a walk.");
  m.def("module_entries", &module_entries, py::arg("model"), py::arg("planned"),
        py::arg("plain_types"), py::arg("wrapped"), py::arg("module_owner"),
        "(name, tensor) of model.state_dict(keep_vars=True) outside `planned`, in one walk; "
        "None when state_dict() must be asked; a type to classify in plain_types first.");
}
