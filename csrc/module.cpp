// pybind11 bindings of gockpt._C (no libtorch link: tensors arrive as raw data pointers,
// validated by gockpt/_kernels.py).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "adam_replay.h"
#include "cuda_math.h"

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

// Name -> enum value; unknown names raise ValueError listing the known ones.
template <typename E>
E parse_name(const std::string& s, std::initializer_list<std::pair<const char*, E>> names,
             const char* what) {
  std::string known;
  for (const auto& kv : names) {
    if (s == kv.first) return kv.second;
    known += (known.empty() ? "" : "|") + std::string(kv.first);
  }
  throw std::invalid_argument(std::string(what) + " must be " + known + ", got '" + s + "'");
}

Impl parse_impl(const std::string& s) {
  return parse_name<Impl>(s, {{"single", Impl::Single}, {"foreach", Impl::Foreach},
                              {"fused", Impl::Fused}, {"cuda-forloop", Impl::CudaForloop},
                              {"cuda-foreach", Impl::CudaForeach},
                              {"cuda-fused", Impl::CudaFused}}, "impl");
}

Isa parse_isa(const std::string& s) {
  return parse_name<Isa>(s, {{"auto", Isa::Auto}, {"generic", Isa::Generic},
                             {"avx2", Isa::Avx2}, {"avx512", Isa::Avx512}}, "isa");
}

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "gockpt C++ core: bitwise-exact replay of torch Adam/AdamW updates";

  mod.def(
      "adam_replay",
      [](uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t g, int64_t n, const std::string& impl,
         bool decoupled, double lr, double beta1, double beta2, double eps, double weight_decay,
         double step, int64_t offset, int64_t full_numel, int torch_threads, int torch_vec,
         int threads, double grad_scale) {
        // field order of ReplayArgs (aggregate initialisation)
        const ReplayArgs a{parse_impl(impl), decoupled, lr, beta1, beta2, eps, weight_decay,
                           step, offset, full_numel, torch_threads, torch_vec, threads,
                           grad_scale};
        if (n < 0 || offset < 0 || offset + n > full_numel)
          throw std::invalid_argument("slice [offset, offset+n) must lie inside [0, full_numel)");
        py::gil_scoped_release release;
        adam_replay(ptr<float>(p), ptr<float>(m), ptr<float>(v), ptr<const float>(g), n, a);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("n"),
      py::arg("impl"), py::arg("decoupled"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("offset"),
      py::arg("full_numel"), py::arg("torch_threads"), py::arg("torch_vec"), py::arg("threads"),
      py::arg("grad_scale") = 0.0,
      "Replay one Adam(W) step in place on raw float32 buffers (addresses as ints); impl is a "
      "CPU torch implementation (single|foreach|fused) or a CUDA one (cuda-forloop|"
      "cuda-foreach|cuda-fused, docs/arithmetics.md).");

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
  mod.def("_set_tile", &set_tile, py::arg("tile"),
          "Benchmarking aid: elements per sqrt tile of the single/foreach kernel (16..16384).");
  mod.def("cuda_powf", &cuda_powf, py::arg("a"), py::arg("b"),
          "powf as CUDA's libdevice computes it (the fused kernel's bias corrections).");
  mod.def("isa", []() { return std::string(isa_name(resolved_isa())); });
  io::bind_io(mod);  // parallel checkpoint I/O and crc32c (csrc/io.cpp)
}
