// pybind11 bindings of gockpt._C (no libtorch link: tensors arrive as raw data pointers,
// validated by gockpt/_kernels.py).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adam_replay.h"

namespace py = pybind11;
using namespace gockpt;

namespace gockpt {
namespace io {
void bind_io(py::module_& m);  // csrc/io.cpp
}
}  // namespace gockpt

namespace {

template <typename T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

Impl parse_impl(const std::string& s) {
  if (s == "single") return Impl::Single;
  if (s == "foreach") return Impl::Foreach;
  if (s == "fused") return Impl::Fused;
  throw std::invalid_argument("impl must be 'single', 'foreach' or 'fused', got '" + s + "'");
}

Isa parse_isa(const std::string& s) {
  if (s == "auto") return Isa::Auto;
  if (s == "generic") return Isa::Generic;
  if (s == "avx2") return Isa::Avx2;
  if (s == "avx512") return Isa::Avx512;
  throw std::invalid_argument("isa must be auto|generic|avx2|avx512");
}

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "gockpt C++ core: bitwise-exact replay of torch Adam/AdamW updates";

  mod.def(
      "adam_replay",
      [](uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t g, int64_t n, const std::string& impl,
         bool decoupled, double lr, double beta1, double beta2, double eps, double weight_decay,
         double step, int64_t offset, int64_t full_numel, int torch_threads, int torch_vec,
         int threads) {
        ReplayArgs a;
        a.impl = parse_impl(impl);
        a.decoupled = decoupled;
        a.lr = lr;
        a.beta1 = beta1;
        a.beta2 = beta2;
        a.eps = eps;
        a.weight_decay = weight_decay;
        a.step = step;
        a.offset = offset;
        a.full_numel = full_numel;
        a.torch_threads = torch_threads;
        a.torch_vec = torch_vec;
        a.threads = threads;
        if (n < 0 || offset < 0 || offset + n > full_numel)
          throw std::invalid_argument("slice [offset, offset+n) must lie inside [0, full_numel)");
        py::gil_scoped_release release;
        adam_replay(ptr<float>(p), ptr<float>(m), ptr<float>(v), ptr<const float>(g), n, a);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("n"),
      py::arg("impl"), py::arg("decoupled"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("offset"),
      py::arg("full_numel"), py::arg("torch_threads"), py::arg("torch_vec"), py::arg("threads"),
      "Replay one Adam(W) step in place on raw float32 buffers (addresses as ints).");

  mod.def("init_vml_sqrt", &init_vml_sqrt, py::arg("lib_path"),
          "Resolve MKL vmsSqrt from an already-loaded library; returns sqrt_backend().");
  mod.def("disable_vml_sqrt", &disable_vml_sqrt);
  mod.def("sqrt_backend", &sqrt_backend);
  mod.def("sqrt_source", &sqrt_source);
  mod.def(
      "torch_sqrt",
      [](uintptr_t in, uintptr_t out, int64_t n) {
        py::gil_scoped_release release;
        torch_sqrt(ptr<const float>(in), ptr<float>(out), n);
      },
      py::arg("inp"), py::arg("out"), py::arg("n"),
      "sqrt as torch computes it on CPU float32 (vmsSqrt if resolved, else IEEE).");
  mod.def("set_isa", [](const std::string& s) { force_isa(parse_isa(s)); }, py::arg("isa"));
  mod.def("_set_block", &set_block, py::arg("block"));
  mod.def("isa", []() { return std::string(isa_name(resolved_isa())); });
  io::bind_io(mod);  // parallel checkpoint I/O and crc32c (csrc/io.cpp)
}
