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
  // Round to nearest even in integers (half.h float_to_bf16), NaN made quiet; each bf16 in the low
  // half of its 32-bit lane.
  static __m256i bf16_lanes(R x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  }
  static __m128i to_bf16(R x) {
    const __m256i r = bf16_lanes(x);
    // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  static __m128i to_f16(R x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_bf16(uint16_t* p, R x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void store_f16(uint16_t* p, R x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }
  static void stream_bf16(uint16_t* p, R x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void stream_f16(uint16_t* p, R x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }

  // [Note: NF4 lookup] in kernel_impl.h. 32 elements a block: the 16 code bytes' nibbles
  // interleaved high first, the elements' table indices in order, e0..e15 and e16..e31.
  static constexpr size_t kNf4Block = 32;
  static constexpr size_t kNf4StreamAlign = 32;  // bytes: vmovntps / vmovntdq
  static void nf4_indices(const uint8_t* p, __m128i& first, __m128i& second) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i lo = _mm_and_si128(bytes, low4);
    first = _mm_unpacklo_epi8(hi, lo);
    second = _mm_unpackhi_epi8(hi, lo);
  }

  // 16-bit outputs: the table's low bytes (a) and high bytes (b), each in both 128-bit lanes
  // (vpshufb looks up within a lane). fp32: its entries 0-7 (a) and 8-15 (b).
  struct Nf4Lut {
    __m256i a, b;
  };
  template <DType D>
  static Nf4Lut nf4_lut(const R* products) {
    if constexpr (D == DType::kFloat32) {
      return {_mm256_castps_si256(products[0]), _mm256_castps_si256(products[1])};
    } else {
      // the 16 values, 16-bit, in order: the 16-bit stores' roundings
      __m256i words;
      if constexpr (D == DType::kBFloat16) {
        // packus per lane: [t0..t3 t8..t11 | t4..t7 t12..t15]; qwords 0 2 1 3 put them in order
        const __m256i packed =
            _mm256_packus_epi32(bf16_lanes(products[0]), bf16_lanes(products[1]));
        words = _mm256_permute4x64_epi64(packed, 0xD8);
      } else {
        words = _mm256_set_m128i(to_f16(products[1]), to_f16(products[0]));
      }
      // per lane: the low bytes of its 8 entries, then their high bytes
      const __m256i planes = _mm256_shuffle_epi8(
          words, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                  0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
      return {_mm256_permute4x64_epi64(planes, 0x88),   // qwords 0 2 0 2: low bytes
              _mm256_permute4x64_epi64(planes, 0xDD)};  // qwords 1 3 1 3: high bytes
    }
  }
  template <bool Stream>
  static void store256(void* p, __m256i x) {
    if constexpr (Stream) {
      _mm256_stream_si256(static_cast<__m256i*>(p), x);
    } else {
      _mm256_storeu_si256(static_cast<__m256i*>(p), x);
    }
  }
  template <DType D, bool Stream>
  static void nf4_expand(const uint8_t* codes, const Nf4Lut& lut, Stored<D>* out) {
    __m128i first, second;
    nf4_indices(codes, first, second);
    if constexpr (D == DType::kFloat32) {
      const __m256 lower = _mm256_castsi256_ps(lut.a), upper = _mm256_castsi256_ps(lut.b);
      const __m128i pieces[4] = {first, _mm_srli_si128(first, 8), second,
                                 _mm_srli_si128(second, 8)};
      for (int k = 0; k < 4; ++k) {
        const __m256i idx = _mm256_cvtepu8_epi32(pieces[k]);
        const __m256 from_lower = _mm256_permutevar8x32_ps(lower, idx);
        const __m256 from_upper = _mm256_permutevar8x32_ps(upper, idx);
        // blendv takes the sign bit: the index's bit 3 (entries 8-15) moved there
        const __m256 use_upper = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        const __m256 v = _mm256_blendv_ps(from_lower, from_upper, use_upper);
        store256<Stream>(out + 8 * k, _mm256_castps_si256(v));
      }
    } else {
      const __m256i idx = _mm256_set_m128i(second, first);
      const __m256i low = _mm256_shuffle_epi8(lut.a, idx);
      const __m256i high = _mm256_shuffle_epi8(lut.b, idx);
      const __m256i x0 = _mm256_unpacklo_epi8(low, high);  // e0..e7 | e16..e23
      const __m256i x1 = _mm256_unpackhi_epi8(low, high);  // e8..e15 | e24..e31
      store256<Stream>(out, _mm256_permute2x128_si256(x0, x1, 0x20));
      store256<Stream>(out + 16, _mm256_permute2x128_si256(x0, x1, 0x31));
    }
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
