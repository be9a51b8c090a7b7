// pybind11 face of csrc/adam: converts Python ints (data pointers, counts,
// enum values) to the C++ core's types and releases the GIL around every
// kernel. No policy lives here: tensor checks and error messages about
// tensors are in infinity/optim (Python); the core's std::invalid_argument
// (hyper-parameters, overlapping buffers, ISA) arrives as ValueError.
// Long argument lists, flags and the ISA/thread options are keyword-only
// (py::kw_only): eight lists of ints in a row are too easy to pass in the
// wrong order. The hyper-parameters cross as one typed value, AdamHyper (the
// core's Hyper, bound below): named fields, keyword construction, checked when
// made, read-only after.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam.h"

namespace py = pybind11;
namespace ad = infinity::adam;

namespace {

ad::DType to_dtype(int code) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument("dtype code must be 0 (float32), 1 (bfloat16) or 2 (float16), got " +
                                std::to_string(code));
  }
  return static_cast<ad::DType>(code);
}

ad::Isa to_isa(int code) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument("isa code must be 0 (scalar), 1 (avx2) or 2 (avx512), got " +
                                std::to_string(code));
  }
  return static_cast<ad::Isa>(code);
}

template <class T>
void check_len(const std::vector<T>& v, size_t n, const char* name) {
  if (v.size() != n) {
    throw std::invalid_argument(std::string(name) + " has " + std::to_string(v.size()) +
                                " entries, params has " + std::to_string(n));
  }
}

// half_dtypes[i] < 0 (or out_halfs[i] == 0): no 16-bit copy for tensor i.
std::vector<ad::Buffers> gather(const std::vector<uintptr_t>& params,
                                const std::vector<uintptr_t>& grads,
                                const std::vector<uintptr_t>& exp_avgs,
                                const std::vector<uintptr_t>& exp_avg_sqs,
                                const std::vector<uintptr_t>& out_halfs,
                                const std::vector<size_t>& numels,
                                const std::vector<int>& grad_dtypes,
                                const std::vector<int>& half_dtypes) {
  const size_t n = params.size();
  check_len(grads, n, "grads");
  check_len(exp_avgs, n, "exp_avgs");
  check_len(exp_avg_sqs, n, "exp_avg_sqs");
  check_len(out_halfs, n, "out_halfs");
  check_len(numels, n, "numels");
  check_len(grad_dtypes, n, "grad_dtypes");
  check_len(half_dtypes, n, "half_dtypes");
  std::vector<ad::Buffers> b(n);
  for (size_t i = 0; i < n; ++i) {
    b[i].param = reinterpret_cast<float*>(params[i]);
    b[i].grad = reinterpret_cast<const void*>(grads[i]);
    b[i].exp_avg = reinterpret_cast<float*>(exp_avgs[i]);
    b[i].exp_avg_sq = reinterpret_cast<float*>(exp_avg_sqs[i]);
    b[i].numel = numels[i];
    b[i].grad_dtype = to_dtype(grad_dtypes[i]);
    if (out_halfs[i] != 0 && half_dtypes[i] >= 0) {
      b[i].out_half = reinterpret_cast<void*>(out_halfs[i]);
      b[i].half_dtype = to_dtype(half_dtypes[i]);
      if (b[i].half_dtype == ad::DType::kFloat32) {
        throw std::invalid_argument("the weight copy must be bfloat16 or float16, not float32");
      }
    }
  }
  return b;
}

py::tuple as_tuple(const ad::Hyper& h) {
  return py::make_tuple(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.adamw, h.bias_correction);
}

}  // namespace

PYBIND11_MODULE(_adam, m) {
  m.doc() = "infinity's CPU Adam kernels (csrc/adam). Use infinity.optim, not this module.";

  m.attr("FLOAT32") = static_cast<int>(ad::DType::kFloat32);
  m.attr("BFLOAT16") = static_cast<int>(ad::DType::kBFloat16);
  m.attr("FLOAT16") = static_cast<int>(ad::DType::kFloat16);
  m.attr("SCALAR") = static_cast<int>(ad::Isa::kScalar);
  m.attr("AVX2") = static_cast<int>(ad::Isa::kAvx2);
  m.attr("AVX512") = static_cast<int>(ad::Isa::kAvx512);

  m.def("isa_supported", [](int isa) { return ad::isa_supported(to_isa(isa)); }, py::arg("isa"),
        "Whether this CPU (and OS) can run the kernels for `isa`.");
  m.def("best_isa", [] { return static_cast<int>(ad::best_isa()); },
        "The widest ISA this CPU supports (chosen from CPUID).");
  m.def("isa_name", [](int isa) { return std::string(ad::isa_name(to_isa(isa))); }, py::arg("isa"));
  m.def("stream_min_bytes", &ad::stream_min_bytes,
        "Steps over more bytes than this (16 per parameter) stream the 16-bit copy past the cache.");
  m.def("set_stream_min_bytes", &ad::set_stream_min_bytes, py::arg("nbytes"));
  m.def("threading_backend", [] { return std::string(ad::threading_backend()); },
        "\"openmp\" (sharing torch's libgomp), or \"serial\" for a build without OpenMP.");

  py::class_<ad::Hyper>(m, "AdamHyper",
                        "The hyper-parameters of an Adam/AdamW step (csrc/adam/adam.h's Hyper).\n\n"
                        "Keyword-only, checked when made (ValueError naming the field), read-only.")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool adamw, bool bias_correction) {
             ad::Hyper h;
             h.lr = lr;
             h.beta1 = beta1;
             h.beta2 = beta2;
             h.eps = eps;
             h.weight_decay = weight_decay;
             h.adamw = adamw;
             h.bias_correction = bias_correction;
             ad::validate(h);
             return h;
           }),
           py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("adamw").noconvert(),
           py::arg("bias_correction").noconvert() = true)
      .def_readonly("lr", &ad::Hyper::lr)
      .def_readonly("beta1", &ad::Hyper::beta1)
      .def_readonly("beta2", &ad::Hyper::beta2)
      .def_readonly("eps", &ad::Hyper::eps)
      .def_readonly("weight_decay", &ad::Hyper::weight_decay)
      .def_readonly("adamw", &ad::Hyper::adamw, "decoupled weight decay (AdamW), or L2 (Adam)")
      .def_readonly("bias_correction", &ad::Hyper::bias_correction)
      .def("__eq__",
           [](const ad::Hyper& a, const ad::Hyper& b) {
             return as_tuple(a).equal(as_tuple(b));
           },
           py::is_operator())
      .def("__hash__", [](const ad::Hyper& h) { return py::hash(as_tuple(h)); })
      .def("__repr__",
           [](const ad::Hyper& h) {
             return py::str("AdamHyper(lr={!r}, beta1={!r}, beta2={!r}, eps={!r}, "
                            "weight_decay={!r}, adamw={!r}, bias_correction={!r})")
                 .format(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.adamw, h.bias_correction);
           })
      .def(py::pickle([](const ad::Hyper& h) { return as_tuple(h); },
                      [](const py::tuple& t) {
                        if (t.size() != 7) {
                          throw std::invalid_argument("AdamHyper's state has 7 fields");
                        }
                        ad::Hyper h;
                        h.lr = t[0].cast<double>();
                        h.beta1 = t[1].cast<double>();
                        h.beta2 = t[2].cast<double>();
                        h.eps = t[3].cast<double>();
                        h.weight_decay = t[4].cast<double>();
                        h.adamw = t[5].cast<bool>();
                        h.bias_correction = t[6].cast<bool>();
                        ad::validate(h);
                        return h;
                      }));

  m.def(
      "adam_step",
      [](const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
         const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
         const std::vector<uintptr_t>& out_halfs, const std::vector<size_t>& numels,
         const std::vector<int>& grad_dtypes, const std::vector<int>& half_dtypes,
         const ad::Hyper& hyper, double step, int isa, int num_threads) {
        const std::vector<ad::Buffers> b =
            gather(params, grads, exp_avgs, exp_avg_sqs, out_halfs, numels, grad_dtypes, half_dtypes);
        const ad::Isa which = to_isa(isa);
        py::gil_scoped_release release;
        ad::adam_step(b.data(), b.size(), hyper, step, which, num_threads);
      },
      py::kw_only(), py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("out_halfs"), py::arg("numels"), py::arg("grad_dtypes"), py::arg("half_dtypes"),
      py::arg("hyper"), py::arg("step"), py::arg("isa"), py::arg("num_threads"),
      "One Adam/AdamW step over tensors given as data pointers (see infinity.optim.adam_step).");

  m.def(
      "has_overflow",
      [](const std::vector<uintptr_t>& data, const std::vector<size_t>& numels,
         const std::vector<int>& dtypes, int isa, int num_threads) {
        const size_t n = data.size();
        check_len(numels, n, "numels");
        check_len(dtypes, n, "dtypes");
        std::vector<const void*> ptrs(n);
        std::vector<ad::DType> types(n);
        for (size_t i = 0; i < n; ++i) {
          ptrs[i] = reinterpret_cast<const void*>(data[i]);
          types[i] = to_dtype(dtypes[i]);
        }
        const ad::Isa which = to_isa(isa);
        py::gil_scoped_release release;
        return ad::has_overflow(ptrs.data(), numels.data(), types.data(), n, which, num_threads);
      },
      py::arg("data"), py::arg("numels"), py::arg("dtypes"), py::kw_only(), py::arg("isa"),
      py::arg("num_threads"),
      "True when any element of the arrays is inf or NaN.");

  m.def(
      "sum_squares",
      [](const std::vector<uintptr_t>& data, const std::vector<size_t>& numels, int isa,
         int num_threads) {
        const size_t n = data.size();
        check_len(numels, n, "numels");
        std::vector<const float*> ptrs(n);
        for (size_t i = 0; i < n; ++i) ptrs[i] = reinterpret_cast<const float*>(data[i]);
        const ad::Isa which = to_isa(isa);
        py::gil_scoped_release release;
        return ad::sum_squares(ptrs.data(), numels.data(), n, which, num_threads);
      },
      py::arg("data"), py::arg("numels"), py::kw_only(), py::arg("isa"), py::arg("num_threads"),
      "The sum of squares of fp32 arrays, accumulated in double in a fixed order.");

  m.def(
      "dequantize_nf4",
      [](uintptr_t codes, uintptr_t absmax, uintptr_t out, int dtype, size_t numel,
         size_t group_size, int isa, int num_threads, uintptr_t scale_codes, uintptr_t scale_code,
         uintptr_t scale_absmax, float scale_offset, size_t scale_block, size_t begin,
         std::optional<size_t> end) {
        const ad::DType d = to_dtype(dtype);
        const ad::Isa which = to_isa(isa);
        ad::Nf4Nested nested;
        nested.codes = reinterpret_cast<const uint8_t*>(scale_codes);
        nested.code = reinterpret_cast<const float*>(scale_code);
        nested.absmax = reinterpret_cast<const float*>(scale_absmax);
        nested.offset = scale_offset;
        nested.block_size = scale_block;
        py::gil_scoped_release release;
        ad::dequantize_nf4(reinterpret_cast<const uint8_t*>(codes),
                           reinterpret_cast<const float*>(absmax),
                           scale_codes == 0 ? nullptr : &nested, reinterpret_cast<void*>(out), d,
                           numel, group_size, which, num_threads, begin, end.value_or(numel));
      },
      py::kw_only(), py::arg("codes"), py::arg("absmax"), py::arg("out"), py::arg("dtype"),
      py::arg("numel"), py::arg("group_size"), py::arg("isa"), py::arg("num_threads"),
      py::arg("scale_codes") = 0, py::arg("scale_code") = 0, py::arg("scale_absmax") = 0,
      py::arg("scale_offset") = 0.0f, py::arg("scale_block") = 256, py::arg("begin") = 0,
      py::arg("end") = py::none(),
      "NF4 codes and their scales (data pointers) dequantised into out (see "
      "infinity.weights.nf4): fp32 absmax, or with scale_codes the scales quantised again "
      "(scale_code: the 256-value code book, scale_absmax: one fp32 per scale_block groups, "
      "scale_offset: their mean); only elements [begin, end) of out (end None: numel).");

  // torch keeps each parameter's step count in its own 0-dim tensor; with
  // hundreds of parameters, reading and bumping them with tensor ops costs more
  // than the step itself on small models. Pointers checked by the caller
  // (infinity/optim/cpu_adam.py): 0-dim CPU float32 or float64.
  m.def(
      "bump_step_counts",
      [](const std::vector<uintptr_t>& ptrs, const std::vector<int>& is_double, double increment) {
        check_len(is_double, ptrs.size(), "is_double");
        std::vector<double> before(ptrs.size());
        for (size_t i = 0; i < ptrs.size(); ++i) {
          if (is_double[i]) {
            auto* p = reinterpret_cast<double*>(ptrs[i]);
            before[i] = *p;
            *p = *p + increment;
          } else {
            auto* p = reinterpret_cast<float*>(ptrs[i]);
            before[i] = *p;
            *p = *p + static_cast<float>(increment);
          }
        }
        return before;
      },
      py::arg("ptrs"), py::kw_only(), py::arg("is_double"), py::arg("increment"),
      "Adds `increment` to each 0-dim step tensor (fp32 or fp64) in place; returns the values before.");

  m.def(
      "stream_bound",
      [](const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
         const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
         const std::vector<size_t>& numels, int isa, int num_threads) {
        const size_t n = params.size();
        const std::vector<uintptr_t> none(n, 0);
        const std::vector<int> f32(n, 0), no_half(n, -1);
        const std::vector<ad::Buffers> b =
            gather(params, grads, exp_avgs, exp_avg_sqs, none, numels, f32, no_half);
        const ad::Isa which = to_isa(isa);
        py::gil_scoped_release release;
        ad::stream_bound(b.data(), b.size(), which, num_threads);
      },
      py::kw_only(), py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("numels"), py::arg("isa"), py::arg("num_threads"),
      "param += grad; exp_avg += grad; exp_avg_sq += grad: the bandwidth bound of a step.");
}
