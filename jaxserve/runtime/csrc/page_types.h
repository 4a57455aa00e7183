// The element types of the paged KV cache (csrc/paged_attention.cc's pages, csrc/kv_write.cc's
// writes): float32, bfloat16, int8 and fp8 (e4m3fn / e5m2), each read as float32 (ToFloat) and
// written (Store).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace jaxserve::attention {

// bfloat16 storage: the top half of a float32. Reading widens exactly; writing rounds to nearest
// even (as XLA's convert does).
struct Bf16 {
  uint16_t bits;
};
inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline void Store(float x, float* dst) { *dst = x; }
inline void Store(float x, Bf16* dst) { dst->bits = RoundBf16(x); }
inline void Store(uint8_t x, uint8_t* dst) { *dst = x; }  // quantized bytes (made by kv_quant.quantize)

// Quantized storage: int8, and fp8 as e4m3fn (4 exponent bits, bias 7, 3 mantissa bits) or e5m2
// (bias 15, 2 mantissa bits). Widening is exact; the NaN codes never occur (values are clipped to
// the format's max before they are stored).
template <int M, int Bias>
struct Fp8 {
  uint8_t bits;
};
using E4m3 = Fp8<3, 7>;
using E5m2 = Fp8<2, 15>;
template <typename T>
constexpr bool kQuant = !std::is_same<T, float>::value && !std::is_same<T, Bf16>::value;

inline float ToFloat(int8_t x) { return static_cast<float>(x); }
// value = mantissa (with its implicit leading one when the exponent field is not zero) * 2^(e - bias - M),
// the power of two made from its bits (always a normal float): no subnormal arithmetic, no table.
template <int M, int Bias>
inline float ToFloat(Fp8<M, Bias> x) {
  const int32_t m = x.bits & ((1 << M) - 1), e = (x.bits >> M) & ((1 << (7 - M)) - 1);
  const uint32_t pow_bits = uint32_t(std::max(e, 1) - Bias - M + 127) << 23;
  float pow;
  std::memcpy(&pow, &pow_bits, sizeof(pow));
  const float v = static_cast<float>(e == 0 ? m : m + (1 << M)) * pow;
  return x.bits & 0x80 ? -v : v;
}

}  // namespace jaxserve::attention
