// Scalar fp32 <-> bf16/fp16 conversions, integer-only so that they do not
// depend on MXCSR or on the compiler's float handling.
//
// fp32 -> 16-bit rounds to nearest even, like torch's `.to(torch.bfloat16)`
// and `.to(torch.float16)` (and like F16C's vcvtps2ph): overflow goes to
// inf, fp16 subnormals are produced exactly, NaN stays a quiet NaN with its
// sign. The SIMD kernels implement the same rules with vector instructions;
// tests check all paths bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace infinity::adam {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {  // inf, or NaN made quiet (as vcvtph2ps does)
    return bits_float(sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
  }
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t x = u & 0x7fffffffu;
  if (x > 0x7f800000u) {  // NaN: quiet, top payload bits kept
    return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: an fp16 subnormal (or zero)
    if (x <= 0x33000000u) return sign;  // <= 2^-25 rounds to zero (the tie goes to even)
    const uint32_t exp = x >> 23;       // 102 ... 112
    const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // value / 2^-24 = mant >> shift
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t y = x - 0x38000000u;  // re-bias the exponent from 127 to 15
  uint32_t r = y >> 13;
  const uint32_t rem = y & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

}  // namespace infinity::adam
