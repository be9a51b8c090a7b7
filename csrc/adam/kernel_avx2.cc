// The AVX2 kernel set (8 floats a vector); compiled with -mavx2 -mfma -mf16c
// and called only where CPUID reports all three (adam.cc).
#include <immintrin.h>

#include "adam/kernel_impl.h"

namespace infinity::adam {
namespace {

struct Avx2 {
  using R = __m256;
  using U = __m256i;
  static constexpr size_t kWidth = 8;
  static constexpr bool kPrefetch = true;
  static constexpr bool kCanStream = true;

  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R sqrt(R a) { return _mm256_sqrt_ps(a); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }

  static R load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static R load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Round to nearest even in integers (half.h float_to_bf16), NaN made quiet.
  static __m128i to_bf16(R x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  static __m128i to_f16(R x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_bf16(uint16_t* p, R x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void store_f16(uint16_t* p, R x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }
  static void stream_bf16(uint16_t* p, R x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void stream_f16(uint16_t* p, R x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }

  // 8 nibbles (4 bytes, high nibble first) as code-book values: two 8-entry permutes, blended on
  // the index's bit 3.
  static R nf4(const uint8_t* p) {
    uint32_t word;
    std::memcpy(&word, p, sizeof word);
    const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(word));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
    const R first = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kNf4Code), idx);
    const R second = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kNf4Code + 8), idx);
    const __m256i upper = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7));
    return _mm256_blendv_ps(first, second, _mm256_castsi256_ps(upper));
  }

  static U zero_u() { return _mm256_setzero_si256(); }
  static U max_abs32(U acc, const float* p) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_max_epu32(acc, _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)));
  }
  static U max_abs16(U acc, const uint16_t* p) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_max_epu16(acc, _mm256_and_si256(x, _mm256_set1_epi16(0x7fff)));
  }
  static uint32_t hmax32(U acc) {
    alignas(32) uint32_t a[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), acc);
    uint32_t m = 0;
    for (uint32_t x : a) m = x > m ? x : m;
    return m;
  }
  static uint32_t hmax16(U acc) {
    alignas(32) uint16_t a[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), acc);
    uint32_t m = 0;
    for (uint32_t x : a) m = x > m ? x : m;
    return m;
  }
  static void fence() { _mm_sfence(); }
};

}  // namespace

const KernelSet& avx2_kernels() {
  static const KernelSet set = Kernels<Avx2>::make(Isa::kAvx2);
  return set;
}

}  // namespace infinity::adam
