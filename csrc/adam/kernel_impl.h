// The Adam step, the overflow check and the bandwidth probe written once over
// a vector abstraction V; each ISA translation unit (kernel_scalar.cc,
// kernel_avx2.cc, kernel_avx512.cc) supplies V and instantiates the set.
// Include only from those files: it must be compiled with their flags.
//
// V provides: R (a register of kWidth floats), load/store (unaligned),
// set1, add, sub, mul, div, sqrt, fmadd(a, b, c) = a * b + c rounded once,
// load_bf16/load_f16 (kWidth 16-bit values -> R), store_bf16/store_f16
// (R -> kWidth 16-bit values, round to nearest even, see half.h) and their
// non-temporal twins stream_bf16/stream_f16 (aligned to 2 * kWidth bytes;
// kCanStream says whether they differ from the plain stores), kPrefetch
// (whether software prefetch pays, see [Note: prefetch]),
// kNf4Block, nf4_lut<D>(products) (a group's table: its 16 fp32 values
// code[q] * scale, 16 / kWidth registers, rounded to D) and nf4_expand<D,
// Stream>(codes, lut, out) (kNf4Block NF4 elements from kNf4Block/2 bytes, high
// nibble first, looked up in it; Stream: non-temporal stores, to an address
// aligned to kNf4StreamAlign bytes; see [Note: NF4 lookup]),
// U (an integer register) with zero_u, max_abs32 (kWidth fp32 bit patterns
// with the sign cleared, max-accumulated), max_abs16 (2 * kWidth 16-bit
// patterns likewise), hmax32, hmax16, and fence() (after streaming stores).
//
// [Note: Adam numerics]
// torch.optim.Adam/AdamW with foreach=False run, per element and in fp32,
// with every Python scalar (a double) rounded to fp32 first:
//   Adam, wd > 0:  g = fma(p, wd, g)                       grad.add(p, alpha=wd)
//   AdamW, wd > 0: p = p * (1 - lr*wd)                     param.mul_(...)
//   m = fma(w, g - m, m), w = 1 - beta1 (w < 0.5)          exp_avg.lerp_(g, w)
//     = fma(w - 1, g - m, g)             (otherwise)
//   v = fma((1 - beta2) * g, g, v * beta2)                 mul_ + addcmul_
//   d = sqrt(v) / sqrt(1 - beta2^step) + eps               sqrt / bc2 + eps
//   p = p + (-(lr / (1 - beta1^step)) * m) / d             addcdiv_
// with the fusions torch's x86-64 CPU kernels have as built (lerp and
// add(alpha) call fmadd; GCC contracts addcmul's multiply-add), found by
// comparing each op bit for bit with torch 2.13. The kernels do exactly these
// operations in this order with the same roundings; files are compiled with
// -ffp-contract=off so the compiler fuses nothing else, and the scalar path
// calls std::fma where torch fuses. So every ISA gives the same bits, and
// exp_avg and exp_avg_sq equal torch's bit for bit. The one op that differs:
// sqrt here is IEEE (correctly rounded), while torch's x86 wheels take it from
// MKL's vsSqrt, an ulp off for ~1% of inputs; so the update, and hence param,
// can differ from torch's by an ulp of the update (relative 6e-8 of lr per
// step), well inside the 1e-6 the tests allow.
// NaN and inf propagate through the same operations, hence like torch.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "adam/half.h"
#include "adam/kernel.h"

namespace infinity::adam {

template <class V>
struct Kernels {
  using R = typename V::R;
  static constexpr size_t W = V::kWidth;
  static constexpr size_t kPrefetchAhead = 256;  // elements: 1 KiB of an fp32 array

  struct Consts {
    R weight_decay, decay, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
    bool lerp_small;
    explicit Consts(const Coeffs& c)
        : weight_decay(V::set1(c.weight_decay)),
          decay(V::set1(c.decay)),
          lerp_coeff(V::set1(c.lerp_coeff)),
          beta2(V::set1(c.beta2)),
          one_minus_beta2(V::set1(c.one_minus_beta2)),
          bc2_sqrt(V::set1(c.bias_correction2_sqrt)),
          eps(V::set1(c.eps)),
          neg_step_size(V::set1(c.neg_step_size)),
          lerp_small(c.lerp_small) {}
  };

  template <DType G>
  static R load_grad(const void* g, size_t i) {
    if constexpr (G == DType::kFloat32) {
      return V::load(static_cast<const float*>(g) + i);
    } else if constexpr (G == DType::kBFloat16) {
      return V::load_bf16(static_cast<const uint16_t*>(g) + i);
    } else {
      return V::load_f16(static_cast<const uint16_t*>(g) + i);
    }
  }

  // H: 0 = no copy, else the DType of the copy. Stream: a non-temporal store
  // to an address aligned to the vector of 16-bit values (see step_range).
  template <int H, bool Stream>
  static void store_half(void* h, size_t i, R x) {
    auto* dst = static_cast<uint16_t*>(h) + i;
    if constexpr (H == static_cast<int>(DType::kBFloat16)) {
      if constexpr (Stream) V::stream_bf16(dst, x); else V::store_bf16(dst, x);
    } else if constexpr (H == static_cast<int>(DType::kFloat16)) {
      if constexpr (Stream) V::stream_f16(dst, x); else V::store_f16(dst, x);
    }
  }

  // One vector of elements; see [Note: Adam numerics].
  template <WeightDecay D>
  static inline void update(const Consts& k, R& p, R g, R& m, R& v) {
    if constexpr (D == WeightDecay::kL2) g = V::fmadd(p, k.weight_decay, g);
    if constexpr (D == WeightDecay::kDecoupled) p = V::mul(p, k.decay);
    const R diff = V::sub(g, m);
    m = V::fmadd(k.lerp_coeff, diff, k.lerp_small ? m : g);
    v = V::fmadd(V::mul(k.one_minus_beta2, g), g, V::mul(v, k.beta2));
    const R denom = V::add(V::div(V::sqrt(v), k.bc2_sqrt), k.eps);
    p = V::add(V::div(V::mul(k.neg_step_size, m), denom), p);
  }

  template <DType G, int H, WeightDecay D, bool Stream>
  static void step_vectors(const Consts& k, const Buffers& b, size_t i, size_t end) {
    float* __restrict p = b.param;
    float* __restrict m = b.exp_avg;
    float* __restrict v = b.exp_avg_sq;
    const auto* g = static_cast<const char*>(b.grad);
    for (; i + W <= end; i += W) {
      if constexpr (V::kPrefetch) {
        // [Note: prefetch] The hardware prefetchers alone leave the SIMD
        // kernels at ~0.89 of the streaming bound: the long sqrt/div chains
        // keep fewer loads in flight than a plain copy does. Asking 1 KiB
        // ahead in each input array brings them to ~0.96 (bench/adam.py; the
        // bound itself gains nothing from it, measured in the same run).
        __builtin_prefetch(p + i + kPrefetchAhead, 1);
        __builtin_prefetch(m + i + kPrefetchAhead, 1);
        __builtin_prefetch(v + i + kPrefetchAhead, 1);
        __builtin_prefetch(g + (i + kPrefetchAhead) * (G == DType::kFloat32 ? 4 : 2), 0);
      }
      R pv = V::load(p + i);
      R mv = V::load(m + i);
      R vv = V::load(v + i);
      update<D>(k, pv, load_grad<G>(b.grad, i), mv, vv);
      V::store(p + i, pv);
      V::store(m + i, mv);
      V::store(v + i, vv);
      store_half<H, Stream>(b.out_half, i, pv);
    }
  }

  // Fewer than W elements [i, end) through stack copies, so that they take the
  // very same instructions (and roundings) as a full vector.
  template <DType G, int H, WeightDecay D>
  static void step_partial(const Consts& k, const Buffers& b, size_t i, size_t end) {
    const size_t n = end - i;
    const size_t gsize = G == DType::kFloat32 ? 4 : 2;
    alignas(64) float tp[W] = {}, tm[W] = {}, tv[W] = {};
    alignas(64) unsigned char tg[W * 4] = {};
    alignas(64) uint16_t th[W] = {};
    std::memcpy(tp, b.param + i, n * 4);
    std::memcpy(tm, b.exp_avg + i, n * 4);
    std::memcpy(tv, b.exp_avg_sq + i, n * 4);
    std::memcpy(tg, static_cast<const unsigned char*>(b.grad) + i * gsize, n * gsize);
    Buffers t = b;
    t.param = tp;
    t.exp_avg = tm;
    t.exp_avg_sq = tv;
    t.grad = tg;
    t.out_half = th;
    step_vectors<G, H, D, false>(k, t, 0, W);
    std::memcpy(b.param + i, tp, n * 4);
    std::memcpy(b.exp_avg + i, tm, n * 4);
    std::memcpy(b.exp_avg_sq + i, tv, n * 4);
    if (H != 0) std::memcpy(static_cast<uint16_t*>(b.out_half) + i, th, n * 2);
  }

  template <DType G, int H, WeightDecay D>
  static void step_range(const Coeffs& c, const Buffers& b, size_t begin, size_t end) {
    const Consts k(c);
    size_t i = begin;
    // [Note: streaming the 16-bit copy] Nothing on this CPU reads the copy
    // soon (it goes to the device). When the step's buffers exceed the
    // last-level cache (c.stream_half, set in adam.cc) it would be evicted
    // before use anyway, so it is written with non-temporal stores: no
    // read-for-ownership of its cache lines, 2 bytes per parameter less
    // traffic (measured +4.5% at 50M params; -2% when it fits in the cache,
    // hence the condition). Those stores need aligned addresses: the elements
    // before the first aligned one go through step_partial.
    constexpr size_t kAlign = W * 2;
    const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.out_half) + i);
    if (H != 0 && V::kCanStream && c.stream_half && addr % 2 == 0) {
      const size_t peel = std::min((kAlign - addr % kAlign) % kAlign / 2, end - i);
      if (peel != 0) step_partial<G, H, D>(k, b, i, i + peel);
      i += peel;
      const size_t body_end = i + (end - i) / W * W;
      step_vectors<G, H, D, true>(k, b, i, body_end);
      i = body_end;
    } else {
      const size_t body_end = i + (end - i) / W * W;
      step_vectors<G, H, D, false>(k, b, i, body_end);
      i = body_end;
    }
    if (i != end) step_partial<G, H, D>(k, b, i, end);
  }

  template <DType G, int H>
  static void step_decay(const Coeffs& c, const Buffers& b, size_t begin, size_t end) {
    switch (c.decay_mode) {
      case WeightDecay::kNone: return step_range<G, H, WeightDecay::kNone>(c, b, begin, end);
      case WeightDecay::kL2: return step_range<G, H, WeightDecay::kL2>(c, b, begin, end);
      case WeightDecay::kDecoupled: return step_range<G, H, WeightDecay::kDecoupled>(c, b, begin, end);
    }
  }

  template <DType G>
  static void step_half(const Coeffs& c, const Buffers& b, size_t begin, size_t end) {
    if (b.out_half == nullptr) return step_decay<G, 0>(c, b, begin, end);
    if (b.half_dtype == DType::kBFloat16) {
      return step_decay<G, static_cast<int>(DType::kBFloat16)>(c, b, begin, end);
    }
    return step_decay<G, static_cast<int>(DType::kFloat16)>(c, b, begin, end);
  }

  static void step(const Coeffs& c, const Buffers& b, size_t begin, size_t end) {
    switch (b.grad_dtype) {
      case DType::kFloat32: step_half<DType::kFloat32>(c, b, begin, end); break;
      case DType::kBFloat16: step_half<DType::kBFloat16>(c, b, begin, end); break;
      case DType::kFloat16: step_half<DType::kFloat16>(c, b, begin, end); break;
    }
    V::fence();
  }

  // Blocks of kBlock elements between looks at the other threads' verdict.
  static constexpr size_t kBlock = 16384;

  static bool has_overflow(const void* data, DType dtype, size_t begin, size_t end,
                           const std::atomic<bool>* found) {
    // A value is inf or NaN when its magnitude bits reach the exponent's all-ones.
    const bool wide = dtype == DType::kFloat32;
    const uint32_t limit = wide ? 0x7f800000u : dtype == DType::kBFloat16 ? 0x7f80u : 0x7c00u;
    const size_t step = wide ? W : 2 * W;
    size_t i = begin;
    while (i < end) {
      if (found != nullptr && found->load(std::memory_order_relaxed)) return true;
      const size_t block_end = end - i > kBlock ? i + kBlock : end;
      typename V::U acc = V::zero_u();
      for (; i + step <= block_end; i += step) {
        acc = wide ? V::max_abs32(acc, static_cast<const float*>(data) + i)
                   : V::max_abs16(acc, static_cast<const uint16_t*>(data) + i);
      }
      uint32_t top = wide ? V::hmax32(acc) : V::hmax16(acc);
      for (; i < block_end; ++i) {  // the rest of the last block
        uint32_t bits;
        if (wide) {
          std::memcpy(&bits, static_cast<const float*>(data) + i, 4);
          bits &= 0x7fffffffu;
        } else {
          bits = static_cast<const uint16_t*>(data)[i] & 0x7fffu;
        }
        top = bits > top ? bits : top;
      }
      if (top >= limit) return true;
    }
    return false;
  }

  // [Note: deterministic sum of squares] Each square of a float is exact in
  // double (48 significant bits), and the sums run in kLanes independent
  // double lanes (lane = element index mod kLanes within the range) folded in
  // a fixed order: the same bits on every ISA, whatever the vector width the
  // compiler picks for this loop. adam.cc adds the ranges in a fixed order too.
  static constexpr size_t kLanes = 16;

  static double sum_squares(const float* x, size_t begin, size_t end) {
    double acc[kLanes] = {};
    size_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      for (size_t l = 0; l < kLanes; ++l) {
        const double d = x[i + l];
        acc[l] += d * d;
      }
    }
    for (size_t l = 0; i < end; ++i, ++l) {
      const double d = x[i];
      acc[l] += d * d;
    }
    for (size_t width = kLanes / 2; width > 0; width /= 2) {
      for (size_t l = 0; l < width; ++l) acc[l] += acc[l + width];
    }
    return acc[0];
  }

  static void stream(const Buffers& b, size_t begin, size_t end) {
    float* __restrict p = b.param;
    float* __restrict m = b.exp_avg;
    float* __restrict v = b.exp_avg_sq;
    const float* __restrict g = static_cast<const float*>(b.grad);
    size_t i = begin;
    for (; i + W <= end; i += W) {
      const R gv = V::load(g + i);
      V::store(p + i, V::add(V::load(p + i), gv));
      V::store(m + i, V::add(V::load(m + i), gv));
      V::store(v + i, V::add(V::load(v + i), gv));
    }
    for (; i < end; ++i) {
      p[i] += g[i];
      m[i] += g[i];
      v[i] += g[i];
    }
  }

  // [Note: NF4 lookup] ([Note: NF4 code book] in kernel.h) A group has one scale, so its elements
  // take at most 16 values: code[q] * scale rounded to the output dtype. Where a group holds a
  // whole block of V::kNf4Block elements, its 16 values are computed once, by the fp32 multiply
  // and the rounding of the ISA's own 16-bit stores (V::nf4_lut, in registers), and its blocks are
  // table lookups (V::nf4_expand: byte shuffles and permutes, no arithmetic); the elements
  // outside whole blocks (an odd start, a group's tail, tiny groups) are computed one at a time,
  // the same multiply and half.h's rounding, which the vector roundings equal bit for bit. Every
  // output is thus a value the format's definition gives, whatever the ISA or the split of the
  // range. An output larger than the last-level
  // cache (a.stream, set in adam.cc) is written with non-temporal stores where a block is aligned
  // to them, as the Adam step's 16-bit copy is ([Note: streaming the 16-bit copy]): it would be
  // evicted before its use anyway, and a plain store first reads every line it writes, 4 bytes
  // of traffic per 16-bit element instead of 2 (the codes and scales are 0.56).
  template <DType D>
  static Stored<D> rounded(float x) {
    if constexpr (D == DType::kFloat32) {
      return x;
    } else if constexpr (D == DType::kBFloat16) {
      return float_to_bf16(x);
    } else {
      return float_to_half(x);
    }
  }

  static uint8_t nibble(const uint8_t* codes, size_t i) {
    const uint8_t byte = codes[i >> 1];
    return (i & 1) ? (byte & 0x0f) : (byte >> 4);
  }

  // Elements [begin, end) whose groups' scales are scales[group - first_group].
  template <DType D>
  static void dequant_nf4_groups(const Nf4Args& a, const float* scales, size_t first_group,
                                 size_t begin, size_t end) {
    static_assert(16 % W == 0, "the table is filled a vector at a time");
    constexpr size_t kBlock = V::kNf4Block;
    static_assert(kBlock % 2 == 0, "a block starts and ends on a byte");
    const uint8_t* __restrict codes = a.codes;
    Stored<D>* __restrict out = static_cast<Stored<D>*>(a.out);
    const size_t g = a.group_size;
    size_t i = begin;
    // one division for the range: per group it would stand in the loop's dependency chain
    for (size_t group = begin / g; i < end; ++group) {
      const size_t stop = std::min(end, (group + 1) * g);
      const float scale = scales[group - first_group];
      if (i & 1) {
        out[i] = rounded<D>(kNf4Code[codes[i >> 1] & 0x0f] * scale);
        ++i;
      }
      // (a table for fewer than its 16 values' worth of elements would cost more than it saves)
      if (i + std::max<size_t>(kBlock, 16) <= stop) {
        const R s = V::set1(scale);
        R products[16 / W];
        for (size_t k = 0; k < 16 / W; ++k) products[k] = V::mul(V::load(kNf4Code + k * W), s);
        const auto lut = V::template nf4_lut<D>(products);
        // a block's bytes are a multiple of kNf4StreamAlign: aligned once, aligned throughout
        const bool aligned = reinterpret_cast<uintptr_t>(out + i) % V::kNf4StreamAlign == 0;
        if (V::kCanStream && a.stream && aligned) {
          for (; i + kBlock <= stop; i += kBlock) {
            V::template nf4_expand<D, true>(codes + (i >> 1), lut, out + i);
          }
        } else {
          for (; i + kBlock <= stop; i += kBlock) {
            V::template nf4_expand<D, false>(codes + (i >> 1), lut, out + i);
          }
        }
      }
      for (; i < stop; ++i) out[i] = rounded<D>(kNf4Code[nibble(codes, i)] * scale);
    }
  }

  // Double-quantised scales ([Note: NF4 double quantisation] in kernel.h) are dequantised a batch
  // of groups ahead into a stack buffer: the dependent loads of each scale then overlap instead of
  // stalling the start of every group (AVX2, group 64, one thread: 13% slower than plain NF4 with
  // the scale computed per group, 4% with the batch; a loaded machine, to be measured again).
  static constexpr size_t kScaleBatch = 256;

  template <DType D>
  static void dequant_nf4_as(const Nf4Args& a, size_t begin, size_t end) {
    if (a.nested == nullptr) return dequant_nf4_groups<D>(a, a.absmax, 0, begin, end);
    const size_t g = a.group_size;
    alignas(64) float scales[kScaleBatch];
    size_t i = begin;
    while (i < end) {
      const size_t first = i / g;
      const size_t last = std::min((end - 1) / g + 1, first + kScaleBatch);
      for (size_t k = first; k < last; ++k) scales[k - first] = nf4_group_scale(a, k);
      const size_t stop = std::min(end, last * g);
      dequant_nf4_groups<D>(a, scales, first, i, stop);
      i = stop;
    }
  }

  static void dequant_nf4(const Nf4Args& a, size_t begin, size_t end) {
    switch (a.dtype) {
      case DType::kFloat32: dequant_nf4_as<DType::kFloat32>(a, begin, end); break;
      case DType::kBFloat16: dequant_nf4_as<DType::kBFloat16>(a, begin, end); break;
      case DType::kFloat16: dequant_nf4_as<DType::kFloat16>(a, begin, end); break;
    }
    V::fence();
  }

  static KernelSet make(Isa isa) {
    return KernelSet{isa, &step, &has_overflow, &sum_squares, &stream, &dequant_nf4};
  }
};

}  // namespace infinity::adam
