// 16-lane float32 vectors (one AVX-512 register) shared by the native kernels.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace jaxserve {

using v16 = float __attribute__((vector_size(64)));  // naturally 64-byte aligned
using i32x16 = int32_t __attribute__((vector_size(64)));
constexpr int kW = 16;  // floats per v16

inline v16 LoadU(const float* src) {
  v16 x;
  std::memcpy(&x, src, sizeof(x));
  return x;
}

// A V (a vector) from the bytes at p, however aligned.
template <typename V, typename T>
inline V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// f's bits as a To of the same size.
template <typename To, typename From>
inline To Bits(From f) {
  To t;
  std::memcpy(&t, &f, sizeof(t));
  return t;
}

// float32 -> bfloat16 bits, rounded to nearest even (XLA's and ml_dtypes' convert; not for NaN).
inline uint16_t RoundBf16(float f) {
  const uint32_t u = Bits<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// n floats (n even) -> n / 2 words of bfloat16 pairs: word i = src[2i] (low half) and src[2i + 1]
// (high half), each as RoundBf16 rounds it; 16 lanes at a time (the compiler's vector code: the same
// bits on every instruction set).
inline void RoundBf16Pairs(const float* src, int64_t n, uint32_t* dst) {
  using u32x16 = uint32_t __attribute__((vector_size(64)));
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const u32x16 u = Load<u32x16>(src + i);
    const u16x16 b = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, u16x16);
    std::memcpy(reinterpret_cast<char*>(dst) + 2 * i, &b, sizeof(b));
  }
  for (; i < n; i += 2) dst[i / 2] = RoundBf16(src[i]) | uint32_t(RoundBf16(src[i + 1])) << 16;
}

// A value the compiler must materialize as it is: -ffast-math may then neither fold a factor into
// the FMAs that use it (it did so for some tile sizes and not others, so a row's result depended on
// the batch) nor add two k steps' products together before adding them to the sum. One AVX-512
// register; two AVX ones (an AVX2 build: "+v" cannot hold 64 bytes there); else memory.
inline void Opaque(v16& w) {
#if defined(__AVX512F__)
  asm("" : "+v"(w));
#elif defined(__AVX__)
  using v8 = float __attribute__((vector_size(32)));
  v8 lo, hi;
  std::memcpy(&lo, &w, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<char*>(&w) + sizeof(lo), sizeof(hi));
  asm("" : "+x"(lo), "+x"(hi));
  std::memcpy(&w, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&w) + sizeof(lo), &hi, sizeof(hi));
#else
  asm("" : "+m"(w));
#endif
}

// 16 float16 values -> float32.
inline v16 Half(const _Float16* p) {
#ifdef __F16C__  // gcc scalarizes the generic _Float16 conversion where the CPU lacks AVX512-FP16
  v16 out;
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
#else
  using h16 = _Float16 __attribute__((vector_size(32)));
  h16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, v16);
#endif
}

// exp of 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial
// (relative error < 2e-7, about glibc's expf). Inputs below -87 give ~1e-38 instead of 0, above 88
// give ~1.6e38 instead of inf (callers only use such lanes as negligible weights, mask them, or
// divide by them). glibc's scalar expf, called once per lane, costs more than a tile's FMAs.
inline v16 Exp(v16 x) {
  using i16 = int32_t __attribute__((vector_size(64)));
  x = x < -87.0f ? v16{} - 87.0f : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  // Round x / ln2 to nearest via a positive truncation (fast-math would fold a magic-number trick).
  const i16 n = __builtin_convertvector(x * 1.44269504f + 128.5f, i16) - 128;
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;
  v16 y = r * (1.0f / 720) + 1.0f / 120;
  y = y * r + 1.0f / 24;
  y = y * r + 1.0f / 6;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  const i16 bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

}  // namespace jaxserve
