// pybind11 bindings of gockpt._C (no libtorch link: tensors arrive as raw data pointers,
// validated by the Python wrappers: gockpt/replay/arithmetic.py, gockpt/storage/io.py,
// gockpt/capture/transfer.py).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "adam_replay.h"
#include "cuda_math.h"
#include "vml.h"

namespace py = pybind11;
using namespace gockpt;

namespace gockpt {
namespace io {
void bind_io(py::module_& m);  // the checkpoint I/O section below
}
namespace batch {
void bind_batch(py::module_& m);  // the batched work section at the end of this file
}
}  // namespace gockpt

namespace {

template <typename T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

// The names of the Impl values, indexed by value (also the impl codes of adam_replay_batch's
// args table: _C.REPLAY_IMPLS).
constexpr const char* kImplNames[] = {"single", "foreach", "fused", "cuda-forloop",
                                      "cuda-foreach", "cuda-fused", "deepspeed-cpu-w1",
                                      "deepspeed-cpu-w8", "deepspeed-cpu-w16",
                                      "deepspeed-cuda-moments"};
constexpr int kImpls = static_cast<int>(sizeof kImplNames / sizeof kImplNames[0]);
static_assert(kImpls == static_cast<int>(Impl::DsCudaMoments) + 1, "one name per Impl value");

// The names of the Isa values, indexed by value.
constexpr const char* kIsaNames[] = {"auto", "generic", "avx2", "avx512"};
static_assert(sizeof kIsaNames / sizeof kIsaNames[0] == static_cast<size_t>(Isa::Avx512) + 1,
              "one name per Isa value");

// Name -> enum value (its index in names); unknown names raise ValueError listing the known ones.
template <typename E, size_t N>
E parse_name(const std::string& s, const char* const (&names)[N], const char* what) {
  std::string known;
  for (size_t i = 0; i < N; ++i) {
    if (s == names[i]) return static_cast<E>(i);
    known += (known.empty() ? "" : "|") + std::string(names[i]);
  }
  throw std::invalid_argument(std::string(what) + " must be " + known + ", got '" + s + "'");
}

Impl parse_impl(const std::string& s) { return parse_name<Impl>(s, kImplNames, "impl"); }

Isa parse_isa(const std::string& s) { return parse_name<Isa>(s, kIsaNames, "isa"); }

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "gockpt C++ core: bitwise-exact replay of torch Adam/AdamW updates";

  mod.def(
      "adam_replay",
      [](uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t g, int64_t n, const std::string& impl,
         bool decoupled, double lr, double beta1, double beta2, double eps, double weight_decay,
         double step, int64_t offset, int64_t full_numel, int threads, double grad_scale,
         double beta1_power, double beta2_power) {
        // field order of ReplayArgs (aggregate initialisation)
        const ReplayArgs a{parse_impl(impl), decoupled, lr, beta1, beta2, eps, weight_decay,
                           step, offset, full_numel, threads, grad_scale, beta1_power,
                           beta2_power};
        if (n < 0 || offset < 0 || offset + n > full_numel)
          throw std::invalid_argument("slice [offset, offset+n) must lie inside [0, full_numel)");
        py::gil_scoped_release release;
        adam_replay(ptr<float>(p), ptr<float>(m), ptr<float>(v), ptr<const float>(g), n, a);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("n"),
      py::arg("impl"), py::arg("decoupled"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("offset"),
      py::arg("full_numel"), py::arg("threads"), py::arg("grad_scale") = 0.0,
      py::arg("beta1_power") = 0.0, py::arg("beta2_power") = 0.0,
      "Replay one Adam(W) step in place on raw float32 buffers (addresses as ints); impl is a "
      "CPU torch implementation (single|foreach|fused), a CUDA one (cuda-forloop|"
      "cuda-foreach|cuda-fused) or DeepSpeed's CPU op (deepspeed-cpu-w{1,8,16}: its SIMD "
      "width; beta{1,2}_power: its running products, 0 = pow), docs/arithmetics.md.");

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
  io::bind_io(mod);        // parallel checkpoint I/O and crc32c (section below)
  batch::bind_batch(mod);  // batched replay, copy engine (last section)
}

// ============================================================================ checkpoint I/O
// Bindings of crc32c (crc32c.h), the parallel checkpoint writer (writer.h) and reader
// (reader.h), wrapped by gockpt/storage/io.py. Memory arrives as raw addresses that the Python
// side validates and keeps alive while the C++ side uses it; the GIL is released around every
// I/O. Results are named types (FinishResult, ReadResult); IoError raises OSError.

#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include "crc32c.h"
#include "io_util.h"
#include "reader.h"
#include "writer.h"

namespace gockpt {
namespace io {

namespace {

void bind_crc32c(py::module_& m) {
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        const void* p = info.ptr;
        py::gil_scoped_release release;
        return crc32c(crc, p, n);
      },
      py::arg("data"), py::arg("crc") = 0, "crc32c of a contiguous buffer, continuing from crc.");
  m.def(
      "crc32c_addr",
      [](uintptr_t addr, uint64_t n, uint32_t crc) {
        py::gil_scoped_release release;
        return crc32c(crc, reinterpret_cast<const void*>(addr), n);
      },
      py::arg("addr"), py::arg("n"), py::arg("crc") = 0);
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"));
  m.def("crc32c_impl", []() { return std::string(crc32c_impl()); });
  m.def("force_crc32c_impl", &force_crc32c_impl, py::arg("which"));
}

// A result type with its fields err and msg (read-only) and a repr showing them; the caller
// adds the type's other fields.
template <typename R>
py::class_<R> bind_result(py::module_& m, const char* name, const char* doc) {
  return py::class_<R>(m, name, doc)
      .def_readonly("err", &R::err)
      .def_readonly("msg", &R::msg)
      .def("__repr__", [name](const R& r) {
        return std::string(name) + "(err=" + std::to_string(r.err) + ", msg=" +
               py::repr(py::str(r.msg)).cast<std::string>() + ")";
      });
}

// The named results of IoWriter.finish() and read_into(), fields read-only.
void bind_results(py::module_& m) {
  bind_result<FinishResult>(m, "FinishResult", "err: 0, an errno, or -1 (msg, bad_tensor, bad_offset say what)")
      .def_readonly("bad_tensor", &FinishResult::bad_tensor, "the tensor not written exactly once, or -1")
      .def_readonly("bad_offset", &FinishResult::bad_offset, "its first byte not written exactly once")
      .def_readonly("crcs", &FinishResult::crcs, "per tensor, the crc32c of each chunk");
  bind_result<ReadResult>(m, "ReadResult", "err: 0 or the errno of the first failed read (msg says where)")
      .def_readonly("bad_item", &ReadResult::bad_item, "the item whose read failed, or -1")
      .def_readonly("direct", &ReadResult::direct, "whether O_DIRECT was used")
      .def_readonly("mismatches", &ReadResult::mismatches, "sorted [(item, chunk, crc32c found)]")
      .def_readonly("truncated", &ReadResult::truncated, "sorted [(item, file offset of the end of file)]");
}

void bind_writer(py::module_& m) {
  py::class_<Writer>(m, "IoWriter", "The parallel writer of one checkpoint data file (csrc/writer.h).")
      .def(py::init([](const std::string& path, uint64_t file_size, py::bytes header,
                       const std::vector<std::pair<uint64_t, uint64_t>>& tensors,
                       uint64_t chunk_bytes, int threads, bool direct) {
             std::string h = header;
             py::gil_scoped_release release;
             return new Writer(path, file_size, h, tensors, chunk_bytes, threads, direct);
           }),
           py::arg("path"), py::arg("file_size"), py::arg("header"), py::arg("tensors"),
           py::arg("chunk_bytes"), py::arg("threads"), py::arg("direct"))
      .def("submit", &Writer::submit, py::arg("tensor"), py::arg("src"), py::arg("tstart"),
           py::arg("len"), py::call_guard<py::gil_scoped_release>())
      .def("finish", &Writer::finish, py::call_guard<py::gil_scoped_release>())
      .def("close", &Writer::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("direct", &Writer::direct)
      .def_property_readonly("fallback_reason", &Writer::fallback_reason)
      .def_property_readonly("threads", &Writer::threads)
      .def("inject_fault", &Writer::inject_fault, py::arg("after_writes"), py::arg("errno"));
}

void bind_reader(py::module_& m) {
  using ItemTuple = std::tuple<uint64_t, uint64_t, uintptr_t, uint64_t, std::vector<uint32_t>>;
  m.def(
      "read_into",
      [](const std::string& path, const std::vector<ItemTuple>& items, bool verify, int threads,
         bool direct) {
        std::vector<ReadItem> v;
        v.reserve(items.size());
        for (auto& t : items) {
          ReadItem r;
          std::tie(r.file_off, r.nbytes, r.dst, r.chunk_bytes, r.crcs) = t;
          v.push_back(std::move(r));
        }
        py::gil_scoped_release release;
        return read_into(path, v, verify, threads, direct);
      },
      py::arg("path"), py::arg("items"), py::arg("verify"), py::arg("threads"), py::arg("direct"),
      "items: (file_offset, nbytes, dst_address, chunk_bytes, crcs); returns a ReadResult.");
}

}  // namespace

void bind_io(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      PyObject* args = Py_BuildValue("(is)", e.err, e.what());
      PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
    }
  });
  bind_crc32c(m);
  bind_results(m);
  bind_writer(m);
  bind_reader(m);
}

}  // namespace io
}  // namespace gockpt

// ============================================================================ batched work
// Bindings of the batched replay (adam_replay.h) and the copy engine (copy_engine.h), wrapped
// by gockpt/replay/arithmetic.py and gockpt/capture/transfer.py. Segment tables arrive as numpy
// int64 arrays (addresses as ints), the replay's args table as one numpy structured array (one
// record per entry), read or copied while the GIL is held; the work runs with the GIL released.

#include <pybind11/numpy.h>

#include <unistd.h>

#include <memory>

#include "copy_engine.h"
#include "digest.h"

namespace gockpt {
namespace batch {

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// The common length of the named arrays (ValueError naming the first that differs).
int64_t common_length(std::initializer_list<std::pair<const char*, const I64*>> arrays) {
  const int64_t n = arrays.begin()->second->size();
  for (const auto& a : arrays)
    if (a.second->size() != n)
      throw std::invalid_argument(std::string(a.first) + " has " + std::to_string(a.second->size()) +
                                  " elements, expected " + std::to_string(n) + " (as " +
                                  arrays.begin()->first + ")");
  return n;
}

void check_non_negative(const char* name, const I64& a) {
  const int64_t* d = a.data();
  for (int64_t i = 0; i < a.size(); ++i)
    if (d[i] < 0)
      throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] is negative");
}

// One entry of adam_replay_batch's args table as Python builds it: a record of the numpy
// dtype _C.REPLAY_ARGS_DTYPE, which is made from this struct (same field names, types and
// offsets), so the table is read in place as a C array of them.
struct ArgsRecord {
  int32_t impl;    // an Impl value (the index of its name in _C.REPLAY_IMPLS)
  bool decoupled;  // AdamW's decoupled weight decay (else Adam's L2 term)
  bool grad_bf16;  // g is bfloat16, consumed as float(g) * float(grad_mul)
  double lr, beta1, beta2, eps, weight_decay;
  double step;                      // the count of this update, after the increment
  double grad_scale;                // CudaFused only: the GradScaler scale (0: none)
  double beta1_power, beta2_power;  // DsCpu only: the op's running products (0: pow)
  double grad_mul;                  // grad_bf16 only (1: float(g) exactly)
};

// The args table as n records in place.  Its dtype is checked field by field (names in order,
// types, offsets, record size) against REPLAY_ARGS_DTYPE, so that a table of another layout
// is refused (ValueError naming the field) and never misread.
const ArgsRecord* args_records(const py::array& args, int64_t* n) {
  auto fail = [](const std::string& why) {
    throw std::invalid_argument("args: " + why + " (a table is a 1-D numpy array of dtype "
                                "_C.REPLAY_ARGS_DTYPE)");
  };
  auto str = [](const py::handle& h) { return py::str(h).cast<std::string>(); };
  if (args.ndim() != 1) fail(std::to_string(args.ndim()) + " dimensions");
  if (!(args.flags() & py::array::c_style)) fail("not contiguous");
  const py::dtype want = py::dtype::of<ArgsRecord>(), got = args.dtype();
  const py::tuple names = want.attr("names");
  const py::object got_names = got.attr("names");  // None: not a structured dtype
  if (got_names.is_none() || py::len(got_names) != names.size())
    fail("dtype " + str(got) + ", expected the fields " + str(names));
  const py::object want_fields = want.attr("fields"), got_fields = got.attr("fields");
  for (size_t i = 0; i < names.size(); ++i) {
    const py::object name = names[i], got_name = got_names[py::int_(i)];
    if (!got_name.equal(name))
      fail("field " + std::to_string(i) + " is '" + str(got_name) + "', expected '" + str(name) +
           "'");
    const py::tuple w = want_fields[name], g = got_fields[name];  // (dtype, byte offset)
    if (!w[0].equal(g[0]) || !w[1].equal(g[1]))
      fail("field '" + str(name) + "' is " + str(g[0]) + " at byte " + str(g[1]) +
           ", expected " + str(w[0]) + " at byte " + str(w[1]));
  }
  if (got.itemsize() != want.itemsize())
    fail("records of " + std::to_string(got.itemsize()) + " bytes, expected " +
         std::to_string(want.itemsize()));
  *n = args.size();
  if (*n > 0 && reinterpret_cast<uintptr_t>(args.data()) % alignof(ArgsRecord) != 0)
    fail("records not aligned in memory");
  return static_cast<const ArgsRecord*>(args.data());
}

void bind_replay_batch(py::module_& m) {
  PYBIND11_NUMPY_DTYPE(ArgsRecord, impl, decoupled, grad_bf16, lr, beta1, beta2, eps,
                       weight_decay, step, grad_scale, beta1_power, beta2_power, grad_mul);
  m.attr("REPLAY_ARGS_DTYPE") = py::dtype::of<ArgsRecord>();
  py::tuple impls(kImpls);
  for (int k = 0; k < kImpls; ++k) impls[k] = py::str(kImplNames[k]);
  m.attr("REPLAY_IMPLS") = impls;
  m.def(
      "adam_replay_batch",
      [](const I64& p, const I64& mm, const I64& v, const I64& g, const I64& numel,
         const I64& offset, const I64& full_numel, const I64& arg, const py::array& args,
         int threads) {
        const int64_t n = common_length({{"p", &p}, {"m", &mm}, {"v", &v}, {"g", &g},
                                         {"numel", &numel}, {"offset", &offset},
                                         {"full_numel", &full_numel}, {"arg", &arg}});
        int64_t na = 0;
        const ArgsRecord* rec = args_records(args, &na);
        std::vector<ReplayArgs> table;
        table.reserve(static_cast<size_t>(na));
        for (int64_t k = 0; k < na; ++k) {
          const ArgsRecord& r = rec[k];
          if (r.impl < 0 || r.impl >= kImpls)
            throw std::invalid_argument("args entry " + std::to_string(k) + ": impl " +
                                        std::to_string(r.impl) + " is not an index into " +
                                        "REPLAY_IMPLS");
          // field order of ReplayArgs (aggregate initialisation); offset, full_numel and
          // threads are the segments' and the call's
          table.push_back({static_cast<Impl>(r.impl), r.decoupled, r.lr, r.beta1, r.beta2, r.eps,
                           r.weight_decay, r.step, 0, 0, 0, r.grad_scale, r.beta1_power,
                           r.beta2_power, r.grad_bf16, r.grad_mul});
        }
        const ReplaySegments segs{p.data(),      mm.data(),     v.data(),          g.data(),
                                  numel.data(),  offset.data(), full_numel.data(), arg.data(), n};
        py::gil_scoped_release release;
        adam_replay_batch(segs, table, threads);
      },
      py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("numel"), py::arg("offset"),
      py::arg("full_numel"), py::arg("arg"), py::arg("args"), py::arg("threads"),
      "One Adam(W) step on many float32 slices (addresses as int64), segment i with entry "
      "arg[i] of the args table; bit-identical to adam_replay per segment.  args: a 1-D numpy "
      "array of dtype REPLAY_ARGS_DTYPE, one record per entry (impl: an index into "
      "REPLAY_IMPLS; grad_bf16: the segments' g are bfloat16, consumed as "
      "float(g) * float(grad_mul)).");
}

// The engine, and the process that made it.
struct PyCopyEngine {
  std::unique_ptr<CopyEngine> owned;
  CopyEngine& engine;
  const pid_t owner = getpid();
  PyCopyEngine(double rate, int64_t piece_bytes)
      : owned(new CopyEngine(rate, piece_bytes)), engine(*owned) {}
  ~PyCopyEngine() {
    if (getpid() != owner) {
      // A forked child (a DataLoader worker) collecting its copy of the parent's engine: the
      // worker thread is the parent's, and its locks may record waiters that never run here
      // (joining, or destroying them, would hang). Leave the memory; the child exits soon.
      (void)owned.release();
      return;
    }
    engine.close();
  }
};

int64_t submit_copies(PyCopyEngine& e, int priority, const I64& dst, const I64& src,
                      const I64& nbytes) {
  const int64_t n = common_length({{"dst", &dst}, {"src", &src}, {"nbytes", &nbytes}});
  check_non_negative("nbytes", nbytes);
  std::vector<CopySegment> segs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    segs[i] = {ptr<void>(static_cast<uintptr_t>(dst.data()[i])),
               ptr<const void>(static_cast<uintptr_t>(src.data()[i])), nbytes.data()[i]};
  return e.engine.submit(priority, std::move(segs));
}

// copy_now(): copies shorter than this keep the GIL (a few milliseconds of memcpy at most).
constexpr int64_t kHoldGilBytes = int64_t{16} << 20;

void bind_copy_engine(py::module_& m) {
  m.def(
      "copy_now",
      [](const I64& dst, const I64& src, const I64& nbytes) {
        const int64_t n = common_length({{"dst", &dst}, {"src", &src}, {"nbytes", &nbytes}});
        check_non_negative("nbytes", nbytes);
        const int64_t *d = dst.data(), *s = src.data(), *b = nbytes.data();
        int64_t total = 0;
        for (int64_t i = 0; i < n; ++i) total += b[i];
        auto copy = [&] {
          for (int64_t i = 0; i < n; ++i) {
            std::memcpy(ptr<void>(static_cast<uintptr_t>(d[i])),
                        ptr<const void>(static_cast<uintptr_t>(s[i])), static_cast<size_t>(b[i]));
          }
        };
        // A short copy keeps the GIL: released, a Python thread waiting for it (the replay's,
        // the persist thread's) may hold it long after the copy is done.
        if (total < kHoldGilBytes) {
          copy();
        } else {
          py::gil_scoped_release release;
          copy();
        }
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "memcpy(dst[i], src[i], nbytes[i]) for every i on the calling thread (the GIL released "
      "for copies of 16 MiB or more): a copy the caller waits for anyway, without an engine "
      "thread's hand-off and wake-up.");
  using E = PyCopyEngine;
  py::class_<E>(m, "CopyEngine",
                "One worker thread running queued host copies by priority "
                "(csrc/copy_engine.h); wrapped by gockpt/capture/transfer.py.")
      .def(py::init<double, int64_t>(), py::arg("link_bytes_per_s") = 0.0,
           py::arg("piece_bytes") = int64_t{1} << 20)
      .def("submit", &submit_copies, py::arg("priority"), py::arg("dst"), py::arg("src"),
           py::arg("nbytes"), "Queue memcpy(dst[i], src[i], nbytes[i]); returns a ticket id.")
      .def(
          "submit_counted",
          [](E& e, int priority, const I64& dst, const I64& src, const I64& nbytes) {
            const int64_t id = submit_copies(e, priority, dst, src, nbytes);
            return py::make_tuple(id, e.engine.nbytes(id));
          },
          py::arg("priority"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
          "submit(), returning (ticket id, the bytes it copies): no sum of its own for the "
          "caller.")
      .def("done", [](const E& e, int64_t t) { return e.engine.done(t); }, py::arg("ticket"))
      .def("wait", [](const E& e, int64_t t) { e.engine.wait(t); }, py::arg("ticket"),
           py::call_guard<py::gil_scoped_release>())
      .def("seconds", [](const E& e, int64_t t) { return e.engine.seconds(t); }, py::arg("ticket"))
      .def(
          "take_done",
          [](E& e, int64_t t) -> py::object {
            double seconds = 0.0;
            if (!e.engine.take_done(t, &seconds)) return py::none();
            return py::float_(seconds);
          },
          py::arg("ticket"),
          "A done ticket's seconds (an unknown id: 0.0), the ticket forgotten; None while it "
          "is not done (never "
          "waits, the GIL kept: a settled copy costs one call, not a wait, seconds and "
          "release each letting the GIL go).")
      .def("nbytes", [](const E& e, int64_t t) { return e.engine.nbytes(t); }, py::arg("ticket"))
      .def("release", [](E& e, int64_t t) { e.engine.release(t); }, py::arg("ticket"),
           py::call_guard<py::gil_scoped_release>(),
           "Wait for the ticket, then forget it (unknown ids: no-op).")
      .def("stats", [](const E& e) { return e.engine.stats(); },
           "(bytes copied, seconds spent copying).")
      .def("close", [](E& e) { e.engine.close(); }, py::call_guard<py::gil_scoped_release>(),
           "Finish queued work and join the worker; idempotent.");
}

}  // namespace

void bind_digests(py::module_& m) {
  m.attr("DIGEST_ROW") = kDigestRow;
  m.def(
      "digests",
      [](const I64& addr, const I64& words, const I64& elsize, int threads) {
        const int64_t n = common_length({{"addr", &addr}, {"words", &words}, {"elsize", &elsize}});
        check_non_negative("words", words);
        py::array_t<int64_t> out({n, int64_t{2}});
        const auto* a = reinterpret_cast<const uint64_t*>(addr.data());
        const int64_t* w = words.data();
        const int64_t* e = elsize.data();
        int64_t* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          digest_batch(a, w, e, n, threads, o);
        }
        return out;
      },
      py::arg("addr"), py::arg("words"), py::arg("elsize"), py::arg("threads"),
      "Digests (a, b) of n regions of words (gockpt/core/digest.py's definition): region i "
      "is words[i] signed words of elsize[i] bytes at addr[i]; an (n, 2) int64 array. "
      "threads: gockpt's pool (<= 0: every core), never torch's.");
  m.def(
      "bf16_images",
      [](uintptr_t g, uintptr_t out, int64_t n, bool with_mul, float mul) {
        if (n < 0) throw std::invalid_argument("bf16_images: negative count");
        py::gil_scoped_release release;
        return bf16_images(reinterpret_cast<const float*>(g), reinterpret_cast<uint16_t*>(out),
                           n, with_mul, mul);
      },
      py::arg("g"), py::arg("out"), py::arg("n"), py::arg("with_mul"), py::arg("mul"),
      "The bf16 gradient transport's images of n float32 at g into out (bf16), one pass "
      "(csrc/digest.h); whether every image times mul gives its gradient back bit for bit.");
}

void bind_batch(py::module_& m) {
  bind_replay_batch(m);
  bind_copy_engine(m);
  bind_digests(m);
}

}  // namespace batch
}  // namespace gockpt
