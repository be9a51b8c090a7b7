// The AVX-512 kernel set (16 floats a vector); compiled with -mavx512f
// -mavx512bw -mavx512vl and called only where CPUID reports them (adam.cc).
#include <immintrin.h>

#include "adam/kernel_impl.h"

namespace infinity::adam {
namespace {

struct Avx512 {
  using R = __m512;
  using U = __m512i;
  static constexpr size_t kWidth = 16;
  static constexpr bool kPrefetch = true;
  static constexpr bool kCanStream = true;

  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R sqrt(R a) { return _mm512_sqrt_ps(a); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }

  static R load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static R load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Round to nearest even in integers (half.h float_to_bf16), NaN made quiet.
  static __m256i to_bf16(R x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i to_f16(R x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_bf16(uint16_t* p, R x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void store_f16(uint16_t* p, R x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(x)); }
  static void stream_bf16(uint16_t* p, R x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void stream_f16(uint16_t* p, R x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(x)); }

  // [Note: NF4 lookup] in kernel_impl.h. The AVX2 set's structure at twice the width: 64 elements
  // a block, 16 code bytes at a time giving the table indices of e0..e15 and e16..e31 in order.
  static constexpr size_t kNf4Block = 64;
  static constexpr size_t kNf4StreamAlign = 64;  // bytes: vmovntps / vmovntdq zmm
  static void nf4_indices(const uint8_t* p, __m128i& first, __m128i& second) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i lo = _mm_and_si128(bytes, low4);
    first = _mm_unpacklo_epi8(hi, lo);
    second = _mm_unpackhi_epi8(hi, lo);
  }

  // The 16 table entries, 16-bit (in the low 256 bits; indices < 16 read no others) or fp32: one
  // vpermw / vpermps looks up 32 or 16 elements.
  struct Nf4Lut {
    __m512i t;
  };
  template <DType D>
  static Nf4Lut nf4_lut(const R* products) {
    if constexpr (D == DType::kFloat32) {
      return {_mm512_castps_si512(products[0])};
    } else if constexpr (D == DType::kBFloat16) {
      return {_mm512_zextsi256_si512(to_bf16(products[0]))};
    } else {
      return {_mm512_zextsi256_si512(to_f16(products[0]))};
    }
  }
  template <bool Stream>
  static void store512(void* p, __m512i x) {
    if constexpr (Stream) {
      _mm512_stream_si512(static_cast<__m512i*>(p), x);
    } else {
      _mm512_storeu_si512(p, x);
    }
  }
  template <DType D, bool Stream>
  static void nf4_expand(const uint8_t* codes, const Nf4Lut& lut, Stored<D>* out) {
    for (int half = 0; half < 2; ++half) {
      __m128i first, second;
      nf4_indices(codes + 16 * half, first, second);
      if constexpr (D == DType::kFloat32) {
        const __m512 table = _mm512_castsi512_ps(lut.t);
        const __m512 lower = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(first), table);
        const __m512 upper = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(second), table);
        store512<Stream>(out + 32 * half, _mm512_castps_si512(lower));
        store512<Stream>(out + 32 * half + 16, _mm512_castps_si512(upper));
      } else {
        const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(second, first));
        store512<Stream>(out + 32 * half, _mm512_permutexvar_epi16(idx, lut.t));
      }
    }
  }

  static U zero_u() { return _mm512_setzero_si512(); }
  static U max_abs32(U acc, const float* p) {
    const __m512i x = _mm512_loadu_si512(p);
    return _mm512_max_epu32(acc, _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)));
  }
  static U max_abs16(U acc, const uint16_t* p) {
    const __m512i x = _mm512_loadu_si512(p);
    return _mm512_max_epu16(acc, _mm512_and_si512(x, _mm512_set1_epi16(0x7fff)));
  }
  static uint32_t hmax32(U acc) { return _mm512_reduce_max_epu32(acc); }
  static uint32_t hmax16(U acc) {
    // Widen the 32 lanes of 16 bits into two vectors of 32-bit lanes.
    const __m512i lo = _mm512_and_si512(acc, _mm512_set1_epi32(0xffff));
    const __m512i hi = _mm512_srli_epi32(acc, 16);
    return _mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi));
  }
  static void fence() { _mm_sfence(); }
};

}  // namespace

const KernelSet& avx512_kernels() {
  static const KernelSet set = Kernels<Avx512>::make(Isa::kAvx512);
  return set;
}

}  // namespace infinity::adam
