// What one SIMD kernel set provides, and the per-step constants it consumes.
//
// A kernel set (scalar, AVX2, AVX-512) is compiled in its own translation unit
// with its own target flags; adam.cc picks one at run time from CPUID and
// calls it on [begin, end) element ranges of one tensor. Kernels are pure
// functions of their inputs: any range split gives the same bits, so the
// thread partitioning never changes results.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "adam/adam.h"

namespace infinity::adam {

enum class WeightDecay : int { kNone = 0, kL2 = 1, kDecoupled = 2 };

// Per-step constants, derived in double from Hyper and rounded to fp32 the
// way torch rounds a Python scalar for an fp32 tensor op (adam.cc).
struct Coeffs {
  WeightDecay decay_mode = WeightDecay::kNone;
  float weight_decay = 0.0f;   // kL2: grad += weight_decay * param
  float decay = 1.0f;          // kDecoupled: param *= 1 - lr * weight_decay
  bool lerp_small = true;      // |1 - beta1| < 0.5: torch's lerp branch
  float lerp_coeff = 0.1f;     // 1 - beta1, or (1 - beta1) - 1 when !lerp_small
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.0f;
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;  // -lr / (1 - beta1^step)
  bool stream_half = false;      // non-temporal stores for the 16-bit copy (kernel_impl.h)
};

// [Note: NF4 code book] QLoRA's 4-bit NormalFloat (Dettmers et al. 2023): 16
// values, quantiles of a standard normal scaled to [-1, 1] with an exact 0,
// as the fp32 constants bitsandbytes dequantises with (its _NF4_QUANT_TABLE;
// written in hex so that no decimal rounding stands between). A weight is
// code[q] * absmax of its group, one fp32 multiply (infinity/weights/quant.py
// lays the codes and scales out; the Python face is infinity.weights.nf4).
inline constexpr float kNf4Code[16] = {
    -0x1p+0f,        -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f,
    -0x1.23449ap-2f, -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f,
    0x1.45f5fep-4f,  0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c3497p-2f,   0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f,
};

// The C++ type of one element stored in `D` (16-bit ones as their bit patterns).
template <DType D>
using Stored = std::conditional_t<D == DType::kFloat32, float, uint16_t>;

// One NF4 dequantisation: element i is the nibble i of `codes` (the high
// nibble of byte i/2 for even i, the low one for odd i, as bitsandbytes packs
// them) looked up in kNf4Code and multiplied by absmax[i / group_size], then
// stored in `dtype` (16-bit: rounded to nearest even, half.h).
struct Nf4Args {
  const uint8_t* codes = nullptr;
  const float* absmax = nullptr;
  const Nf4Nested* nested = nullptr;  // non-null: the scales are quantised (absmax unused)
  void* out = nullptr;
  DType dtype = DType::kFloat32;
  size_t group_size = 64;
  bool stream = false;  // non-temporal stores for the output ([Note: NF4 lookup] in kernel_impl.h)
};

// [Note: NF4 double quantisation] QLoRA's "double quant" (bitsandbytes' compress_statistics=True):
// the fp32 absmax of each group is itself quantised, its mean subtracted (`offset`) and the rest
// cut into blocks of 256 scales, each block 8-bit blockwise over bitsandbytes' signed dynamic code
// (create_dynamic_map) with its own fp32 absmax. 0.5 + 1/64 + 4/(64*256) bytes per weight at
// group 64, against 0.5 + 4/64 without. A group's scale is dequantised once, as bitsandbytes does
// before its 4-bit pass: one multiply and one add, each rounded (files are compiled with
// -ffp-contract=off, so nothing fuses them): the same bits on every ISA, equal to bitsandbytes'
// dequantize_4bit of the nested state (tests/weights/test_nf4_oracle.py). Quantising is Python
// (infinity/weights/nf4.py quantize_scales), once per weight.
inline float nf4_group_scale(const Nf4Args& a, size_t group) {
  if (a.nested == nullptr) return a.absmax[group];
  const Nf4Nested& s = *a.nested;
  const float unshifted = s.code[s.codes[group]] * s.absmax[group / s.block_size];
  return unshifted + s.offset;
}

struct KernelSet {
  Isa isa;
  void (*step)(const Coeffs& c, const Buffers& b, size_t begin, size_t end);
  // True when [begin, end) of `data` holds an inf or NaN. Stops early (and
  // returns true) once *found is set by another thread.
  bool (*has_overflow)(const void* data, DType dtype, size_t begin, size_t end,
                       const std::atomic<bool>* found);
  // The sum of x[i]^2 over [begin, end), accumulated in double; the same bits
  // on every ISA ([Note: deterministic sum of squares] in kernel_impl.h).
  double (*sum_squares)(const float* x, size_t begin, size_t end);
  void (*stream)(const Buffers& b, size_t begin, size_t end);
  // Elements [begin, end) of an NF4 dequantisation; the same bits on every ISA
  // (a group's 16 values one multiply each, nothing fused, its elements looked
  // up: [Note: NF4 lookup] in kernel_impl.h) for any split of the range.
  void (*dequant_nf4)(const Nf4Args& a, size_t begin, size_t end);
};

const KernelSet& scalar_kernels();
#if defined(INFINITY_ADAM_X86)
const KernelSet& avx2_kernels();
const KernelSet& avx512_kernels();
#endif

}  // namespace infinity::adam
