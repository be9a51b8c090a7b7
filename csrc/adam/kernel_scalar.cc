// The portable kernel set: one element at a time, plain C++ (the fallback on
// x86-64 CPUs without AVX2, and the path on arm64, where the compiler may
// vectorize it with NEON). Same operations as the SIMD sets, bit for bit.
#include <cmath>

#include "adam/half.h"
#include "adam/kernel_impl.h"

namespace infinity::adam {
namespace {

struct Scalar {
  using R = float;
  using U = uint32_t;
  static constexpr size_t kWidth = 1;
  static constexpr bool kPrefetch = false;
  static constexpr bool kCanStream = false;

  static R load(const float* p) { return *p; }
  static void store(float* p, R x) { *p = x; }
  static R set1(float x) { return x; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R div(R a, R b) { return a / b; }
  static R sqrt(R a) { return std::sqrt(a); }
  static R fmadd(R a, R b, R c) { return std::fma(a, b, c); }
  static R load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static R load_f16(const uint16_t* p) { return half_to_float(*p); }
  static void store_bf16(uint16_t* p, R x) { *p = float_to_bf16(x); }
  static void store_f16(uint16_t* p, R x) { *p = float_to_half(x); }
  static void stream_bf16(uint16_t* p, R x) { store_bf16(p, x); }
  static void stream_f16(uint16_t* p, R x) { store_f16(p, x); }

  // [Note: NF4 lookup] in kernel_impl.h: one byte (two elements) a block, looked up in the group's
  // 16 values rounded by this set's own 16-bit stores.
  static constexpr size_t kNf4Block = 2;
  static constexpr size_t kNf4StreamAlign = 1;  // no streaming stores (kCanStream)
  template <DType D>
  struct Nf4Lut {
    Stored<D> t[16];
  };
  template <DType D>
  static Nf4Lut<D> nf4_lut(const R* products) {
    Nf4Lut<D> lut;
    for (int k = 0; k < 16; ++k) {
      if constexpr (D == DType::kFloat32) {
        lut.t[k] = products[k];
      } else if constexpr (D == DType::kBFloat16) {
        store_bf16(&lut.t[k], products[k]);
      } else {
        store_f16(&lut.t[k], products[k]);
      }
    }
    return lut;
  }
  template <DType D, bool Stream>
  static void nf4_expand(const uint8_t* codes, const Nf4Lut<D>& lut, Stored<D>* out) {
    out[0] = lut.t[codes[0] >> 4];
    out[1] = lut.t[codes[0] & 0x0f];
  }

  static U zero_u() { return 0; }
  static U max_abs32(U acc, const float* p) {
    const U bits = float_bits(*p) & 0x7fffffffu;
    return bits > acc ? bits : acc;
  }
  static U max_abs16(U acc, const uint16_t* p) {
    const U a = p[0] & 0x7fffu, b = p[1] & 0x7fffu;
    const U m = a > b ? a : b;
    return m > acc ? m : acc;
  }
  static uint32_t hmax32(U acc) { return acc; }
  static uint32_t hmax16(U acc) { return acc; }
  static void fence() {}
};

}  // namespace

const KernelSet& scalar_kernels() {
  static const KernelSet set = Kernels<Scalar>::make(Isa::kScalar);
  return set;
}

}  // namespace infinity::adam
