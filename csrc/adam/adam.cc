// Dispatch for csrc/adam: checks arguments, derives the fp32 step constants
// from the double hyper-parameters, picks the kernel set for the ISA, and
// hands the elements of all tensors of a call to the threads in chunks.
//
// [Note: partitioning]
// A call's tensors are laid end to end in one index space, cut into chunks of
// kChunkElements (a multiple of 64 elements, so that two threads write to a
// common cache line only where a tensor boundary falls inside one), which
// the threads take in turn from an atomic counter until none are left.
// Taking work dynamically rather than in fixed shares matters on a busy
// machine: a thread that lost its core (to I/O workers, to another process)
// holds up the step by one chunk, not by its whole share. One parallel region
// per call however many tensors: 200 small tensors cost one dispatch, not
// 200. Kernels give the same bits for any split (kernel.h), so results do not
// depend on the thread count or on which thread took which chunk. Threads:
// [Note: threads] in parallel.h.
#include "adam/adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "adam/kernel.h"
#include "adam/parallel.h"

namespace infinity::adam {
namespace {

// Below this many elements per thread a wake-up costs more than it saves.
constexpr size_t kMinElementsPerThread = 32768;
// The unit threads take work in ([Note: partitioning]); 128 KiB of each fp32 array.
constexpr size_t kChunkElements = 32768;

size_t dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

size_t last_level_cache_bytes() {
  long bytes = -1;
#if defined(_SC_LEVEL3_CACHE_SIZE)
  bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
  if (bytes <= 0) bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  return bytes > 0 ? static_cast<size_t>(bytes) : size_t{32} << 20;  // unknown: 32 MiB
}

std::atomic<size_t> g_stream_min_bytes{last_level_cache_bytes()};

const KernelSet& kernels_for(Isa isa) {
  if (!isa_supported(isa)) {
    throw std::invalid_argument(std::string("the ") + isa_name(isa) +
                                " kernels cannot run on this CPU (best available: " +
                                isa_name(best_isa()) + ")");
  }
  switch (isa) {
#if defined(INFINITY_ADAM_X86)
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx2: return avx2_kernels();
#endif
    default: return scalar_kernels();
  }
}

std::string fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

void require(bool ok, const std::string& what, double got) {
  if (!ok) throw std::invalid_argument(what + ", got " + fmt(got));
}

}  // namespace

void validate(const Hyper& h) {
  require(std::isfinite(h.lr) && h.lr >= 0, "lr must be a finite number >= 0", h.lr);
  require(h.beta1 >= 0 && h.beta1 < 1, "beta1 must be in [0, 1)", h.beta1);
  require(h.beta2 >= 0 && h.beta2 < 1, "beta2 must be in [0, 1)", h.beta2);
  require(std::isfinite(h.eps) && h.eps >= 0, "eps must be a finite number >= 0", h.eps);
  require(std::isfinite(h.weight_decay) && h.weight_decay >= 0,
          "weight_decay must be a finite number >= 0", h.weight_decay);
}

namespace {

// See [Note: Adam numerics] in kernel_impl.h: every scalar is computed in
// double as torch.optim computes it in Python, then rounded to fp32 once.
Coeffs derive(const Hyper& h, double step) {
  validate(h);
  require(std::isfinite(step) && step >= 1,
          "step must be >= 1 (the number of this update; 1 for the first)", step);
  Coeffs c;
  if (h.weight_decay != 0) c.decay_mode = h.adamw ? WeightDecay::kDecoupled : WeightDecay::kL2;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w = static_cast<float>(1.0 - h.beta1);
  c.lerp_small = std::fabs(w) < 0.5f;
  c.lerp_coeff = c.lerp_small ? w : w - 1.0f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  double bias_correction1 = 1.0;
  double bias_correction2 = 1.0;
  if (h.bias_correction) {
    bias_correction1 = 1.0 - std::pow(h.beta1, step);
    bias_correction2 = 1.0 - std::pow(h.beta2, step);
  }
  c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  c.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  c.eps = static_cast<float>(h.eps);
  return c;
}

struct Range {
  uintptr_t begin, end;
  size_t tensor;
  const char* role;
  bool written;
};

// Writing through one buffer while reading or writing an overlapping one
// would make the result depend on thread timing: refuse it. Only gradients
// (read-only) may share memory with each other.
void check_no_overlap(const Buffers* t, size_t count) {
  std::vector<Range> r;
  r.reserve(count * 5);
  for (size_t k = 0; k < count; ++k) {
    const Buffers& b = t[k];
    if (b.numel == 0) continue;
    auto add = [&](const void* p, size_t elem, const char* role, bool written) {
      if (p == nullptr) {
        throw std::invalid_argument(std::string("tensor ") + std::to_string(k) + "'s " + role +
                                    " is a null pointer");
      }
      const auto a = reinterpret_cast<uintptr_t>(p);
      r.push_back({a, a + b.numel * elem, k, role, written});
    };
    add(b.param, 4, "param", true);
    add(b.grad, dtype_size(b.grad_dtype), "grad", false);
    add(b.exp_avg, 4, "exp_avg", true);
    add(b.exp_avg_sq, 4, "exp_avg_sq", true);
    if (b.out_half != nullptr) add(b.out_half, 2, "out_half", true);
  }
  std::sort(r.begin(), r.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  // Track the written range reaching furthest and any range reaching furthest.
  const Range* far_any = nullptr;
  const Range* far_written = nullptr;
  for (const Range& x : r) {
    const Range* hit = nullptr;
    if (far_written != nullptr && far_written->end > x.begin) hit = far_written;
    if (hit == nullptr && x.written && far_any != nullptr && far_any->end > x.begin) hit = far_any;
    if (hit != nullptr) {
      throw std::invalid_argument(
          "tensor " + std::to_string(hit->tensor) + "'s " + hit->role + " overlaps tensor " +
          std::to_string(x.tensor) + "'s " + x.role +
          " in memory; the step writes to it, so each buffer needs memory of its own");
    }
    if (far_any == nullptr || x.end > far_any->end) far_any = &x;
    if (x.written && (far_written == nullptr || x.end > far_written->end)) far_written = &x;
  }
}

int check_threads(int num_threads) {
  if (num_threads < 1) {
    throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  return num_threads;
}

// Calls f(tensor, begin, end) over all elements, split per [Note: partitioning] into chunks of
// `chunk` elements (a multiple of 64 where writes could share a cache line).
template <class F>
void parallel_ranges(const std::vector<size_t>& starts, int num_threads, F&& f,
                     size_t chunk = kChunkElements) {
  const size_t count = starts.size() - 1;
  const size_t total = starts.back();
  if (total == 0) return;
  const size_t by_size = std::max<size_t>(1, total / kMinElementsPerThread);
  const size_t wanted = std::min<size_t>(static_cast<size_t>(num_threads), by_size);
  const size_t chunks = (total + chunk - 1) / chunk;
  std::atomic<size_t> next{0};
  parallel_run(static_cast<int>(wanted), [&] {
    for (;;) {
      const size_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      const size_t lo = c * chunk;
      const size_t hi = std::min(total, lo + chunk);
      size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) -
                                     starts.begin()) - 1;
      for (; k < count && starts[k] < hi; ++k) {
        const size_t b = std::max(lo, starts[k]) - starts[k];
        const size_t e = std::min(hi, starts[k + 1]) - starts[k];
        if (b < e) f(k, b, e);
      }
    }
  });
}

std::vector<size_t> prefix(const size_t* numel, size_t count) {
  std::vector<size_t> starts(count + 1, 0);
  for (size_t k = 0; k < count; ++k) starts[k + 1] = starts[k] + numel[k];
  return starts;
}

std::vector<size_t> prefix(const Buffers* t, size_t count) {
  std::vector<size_t> starts(count + 1, 0);
  for (size_t k = 0; k < count; ++k) starts[k + 1] = starts[k] + t[k].numel;
  return starts;
}

}  // namespace

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
#if defined(INFINITY_ADAM_X86)
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
    default: return false;
  }
}

Isa best_isa() {
  static const Isa best = isa_supported(Isa::kAvx512) ? Isa::kAvx512
                          : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kScalar;
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

const char* threading_backend() { return parallel_backend(); }

size_t stream_min_bytes() { return g_stream_min_bytes.load(); }
void set_stream_min_bytes(size_t bytes) { g_stream_min_bytes.store(bytes); }

void adam_step(const Buffers* tensors, size_t count, const Hyper& hyper, double step, Isa isa,
               int num_threads) {
  Coeffs c = derive(hyper, step);
  const KernelSet& k = kernels_for(isa);
  check_threads(num_threads);
  check_no_overlap(tensors, count);
  const std::vector<size_t> starts = prefix(tensors, count);
  // [Note: streaming the 16-bit copy] in kernel_impl.h: only when the step's
  // buffers (16 bytes per parameter and more) cannot stay in the cache anyway.
  c.stream_half = starts.back() * 16 > g_stream_min_bytes.load(std::memory_order_relaxed);
  parallel_ranges(starts, num_threads,
                  [&](size_t t, size_t b, size_t e) { k.step(c, tensors[t], b, e); });
}

bool has_overflow(const void* const* data, const size_t* numel, const DType* dtypes, size_t count,
                  Isa isa, int num_threads) {
  const KernelSet& k = kernels_for(isa);
  check_threads(num_threads);
  std::atomic<bool> found{false};
  parallel_ranges(prefix(numel, count), num_threads, [&](size_t t, size_t b, size_t e) {
    if (found.load(std::memory_order_relaxed)) return;
    if (k.has_overflow(data[t], dtypes[t], b, e, &found)) {
      found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

double sum_squares(const float* const* data, const size_t* numel, size_t count, Isa isa,
                   int num_threads) {
  const KernelSet& k = kernels_for(isa);
  check_threads(num_threads);
  const std::vector<size_t> starts = prefix(numel, count);
  // One partial per chunk of the global element range: a chunk is taken by one
  // thread and its pieces come in tensor order, so each partial, and their sum
  // in chunk order, is independent of the thread count.
  std::vector<double> partial((starts.back() + kChunkElements - 1) / kChunkElements, 0.0);
  parallel_ranges(starts, num_threads, [&](size_t t, size_t b, size_t e) {
    partial[(starts[t] + b) / kChunkElements] += k.sum_squares(data[t], b, e);
  });
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

void stream_bound(const Buffers* tensors, size_t count, Isa isa, int num_threads) {
  const KernelSet& k = kernels_for(isa);
  check_threads(num_threads);
  parallel_ranges(prefix(tensors, count), num_threads,
                  [&](size_t t, size_t b, size_t e) { k.stream(tensors[t], b, e); });
}

void dequantize_nf4(const uint8_t* codes, const float* absmax, const Nf4Nested* nested, void* out,
                    DType dtype, size_t numel, size_t group_size, Isa isa, int num_threads,
                    size_t begin, size_t end) {
  const KernelSet& k = kernels_for(isa);
  check_threads(num_threads);
  if (group_size == 0) throw std::invalid_argument("group_size must be >= 1, got 0");
  if (nested != nullptr && nested->block_size == 0) {
    throw std::invalid_argument("the nested scales' block_size must be >= 1, got 0");
  }
  if (begin > end || end > numel) {
    throw std::invalid_argument(
        "dequantize_nf4: the range [" + std::to_string(begin) + ", " + std::to_string(end) +
        ") is not inside the " + std::to_string(numel) +
        " elements; give 0 <= begin <= end <= numel");
  }
  if (begin == end) return;
  if (codes == nullptr || out == nullptr || (nested == nullptr && absmax == nullptr)) {
    throw std::invalid_argument("dequantize_nf4: codes, absmax and out must not be null");
  }
  if (nested != nullptr &&
      (nested->codes == nullptr || nested->code == nullptr || nested->absmax == nullptr)) {
    throw std::invalid_argument(
        "dequantize_nf4: the nested scales' codes, code book and absmax must not be null");
  }
  const auto lo = reinterpret_cast<uintptr_t>(out);
  const uintptr_t hi = lo + numel * dtype_size(dtype);
  auto overlaps = [&](const void* p, size_t nbytes) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    return a < hi && lo < a + nbytes;
  };
  const size_t groups = (numel + group_size - 1) / group_size;
  const bool scales_overlap =
      nested == nullptr
          ? overlaps(absmax, groups * sizeof(float))
          : overlaps(nested->codes, groups) || overlaps(nested->code, 256 * sizeof(float)) ||
                overlaps(nested->absmax,
                         (groups + nested->block_size - 1) / nested->block_size * sizeof(float));
  if (overlaps(codes, (numel + 1) / 2) || scales_overlap) {
    throw std::invalid_argument(
        "dequantize_nf4: out overlaps the codes or the scales; give it memory of its own");
  }
  // [Note: NF4 lookup] in kernel_impl.h: stream an output the cache cannot hold anyway.
  const bool stream = (end - begin) * dtype_size(dtype) > g_stream_min_bytes.load();
  const Nf4Args args{codes, absmax, nested, out, dtype, group_size, stream};
  // Chunks of whole groups starting on a byte ([Note: NF4 lookup] in kernel_impl.h: a group cut
  // in two builds its table twice, and a range starting mid-byte takes its first element alone),
  // and a multiple of 64 elements (no cache line written by two threads) where the groups allow.
  const size_t whole = group_size % 2 == 0 ? group_size : 2 * group_size;
  const size_t aligned = std::lcm<size_t>(whole, 64);
  const size_t unit = aligned <= kChunkElements ? aligned : whole;
  const size_t chunk = std::max<size_t>(1, kChunkElements / unit) * unit;
  // The chunks are laid from element 0, so that they stay whole groups for any begin.
  parallel_ranges(
      {0, end}, num_threads,
      [&](size_t, size_t b, size_t e) {
        if (e > begin) k.dequant_nf4(args, std::max(b, begin), e);
      },
      chunk);
}

}  // namespace infinity::adam
