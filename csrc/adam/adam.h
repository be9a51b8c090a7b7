// The CPU Adam/AdamW step over flat fp32 buffers: the core of csrc/adam.
//
// One pass per element reads param, grad, exp_avg, exp_avg_sq, writes param,
// exp_avg, exp_avg_sq and, optionally, a bf16/fp16 copy of the new param (what
// the device reads next). Gradients may be fp32, bf16 or fp16. The math is
// torch.optim.Adam/AdamW (foreach=False) operation for operation; see
// [Note: Adam numerics] in kernel_impl.h.
//
// Invariants: every buffer is contiguous, holds `numel` elements, and no two
// buffers of one tensor overlap (checked; std::invalid_argument otherwise).
// Threading: adam_step() and has_overflow() may be called from any thread;
// each call splits its elements over up to `num_threads` OpenMP threads (the
// caller is one of them) and returns when all are done (parallel.h).
//
// This layer knows neither torch nor pybind11: raw pointers and counts only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace infinity::adam {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The instruction set a kernel is compiled for; chosen at run time (CPUID).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// One parameter tensor's flat buffers.
struct Buffers {
  float* param = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* out_half = nullptr;  // nullptr: no 16-bit copy
  size_t numel = 0;
  DType grad_dtype = DType::kFloat32;
  DType half_dtype = DType::kBFloat16;  // ignored when out_half is nullptr
};

// The hyper-parameters of a step, as the user gives them (double, like
// Python); bound to Python as infinity.optim.AdamHyper (bindings.cc), so one
// typed value crosses the boundary instead of a row of positional numbers.
// The step count is not among them: it is per tensor and per call.
struct Hyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;            // decoupled weight decay (AdamW) or L2 (Adam)
  bool bias_correction = true;
};

// Throws std::invalid_argument naming the first field out of range.
void validate(const Hyper& hyper);

bool isa_supported(Isa isa);
Isa best_isa();
const char* isa_name(Isa isa);

// "openmp", or "serial" for a build without OpenMP.
const char* threading_backend();

// Steps whose buffers exceed this many bytes (16 per parameter) write the
// 16-bit copy with non-temporal stores, and NF4 dequantisations whose output
// exceeds it write that; default: the last-level cache size.
// Process-wide; tests lower it to exercise that path on small tensors.
size_t stream_min_bytes();
void set_stream_min_bytes(size_t bytes);

// Updates `count` tensors in place; `step` is the number of this update (1
// for the first). Throws std::invalid_argument on a bad hyper-parameter or
// step, an unsupported ISA, or overlapping buffers.
void adam_step(const Buffers* tensors, size_t count, const Hyper& hyper, double step, Isa isa,
               int num_threads);

// True when any element of the `count` arrays is inf or NaN.
bool has_overflow(const void* const* data, const size_t* numel, const DType* dtypes, size_t count,
                  Isa isa, int num_threads);

// The sum of the squares of every element of `count` fp32 arrays, accumulated
// in double in a fixed order: the same result on every ISA and thread count
// (the gradient norm, which must not depend on the machine).
double sum_squares(const float* const* data, const size_t* numel, size_t count, Isa isa,
                   int num_threads);

// The bandwidth bound of an Adam step: reads four fp32 arrays and writes three
// of them in place (param += grad, exp_avg += grad, exp_avg_sq += grad) with
// the same loads, stores, threads and partitioning as adam_step, no Adam math.
void stream_bound(const Buffers* tensors, size_t count, Isa isa, int num_threads);

// The per-group scales of an NF4 tensor quantised again ([Note: NF4 double quantisation] in
// kernel.h): group g's scale is code[codes[g]] * absmax[g / block_size] + offset in fp32, the
// multiply and the add each rounded (bitsandbytes' dequantize_blockwise, then `absmax += offset`).
struct Nf4Nested {
  const uint8_t* codes = nullptr;  // one 8-bit code per group
  const float* code = nullptr;     // the 256 values those codes index
  const float* absmax = nullptr;   // one fp32 scale per block of block_size groups
  float offset = 0.0f;             // the mean of the scales, subtracted before quantising them
  size_t block_size = 256;
};

// Dequantises `numel` NF4 elements: out[i] = code[nibble i] * scale[i / group_size] in `dtype`
// ([Note: NF4 code book] in kernel.h), where scale is `absmax` (ceil(numel / group_size) floats)
// or, when `nested` is given (absmax is then unused), the scales it holds, dequantised in the same
// pass. `codes` holds ceil(numel / 2) bytes. Only elements [begin, end) of `out` are written
// (0 and numel: all of them). The same bits on every ISA and thread count. Throws
// std::invalid_argument on a group_size or block_size of 0, a null pointer, `out` overlapping an
// input, or a range not inside [0, numel].
void dequantize_nf4(const uint8_t* codes, const float* absmax, const Nf4Nested* nested, void* out,
                    DType dtype, size_t numel, size_t group_size, Isa isa, int num_threads,
                    size_t begin, size_t end);

}  // namespace infinity::adam
