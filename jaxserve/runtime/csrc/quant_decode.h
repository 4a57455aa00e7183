// The quantized-weight matmul's decoding (csrc/quant_matmul.cc's formats): a panel's k-rows of 64
// weights decoded in registers into four 16-lane float vectors, right before the FMAs that use them.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "formats.h"
#include "vec.h"

// The formats' ids (Format: kINT8, kQ8_0, ...), kPanel, kBlock and kSuper (K-quants' super-block)
// come from formats.h, which runtime/native_build.py generates from runtime/weight_formats.py.
namespace jaxserve::quant_matmul {

constexpr int kNV = kPanel / kW;
constexpr Format kDecoded = Format(kFormats);  // not a weight format: a panel already decoded

// One panel of a quantized weight: its quants and, for the block formats, per-block d and m.
struct Panel {
  const uint8_t* q;
  const _Float16* d;
  const _Float16* m;
  const float* f = nullptr;  // kDecoded
  const uint8_t* s = nullptr;  // K-quants: the sub-blocks' integer scales
};

using i8x16 = int8_t __attribute__((vector_size(16)));
using u8x16 = uint8_t __attribute__((vector_size(16)));

// 16 small integers -> floats, through int32 (gcc scalarizes a direct int8 -> float conversion,
// and the signed widening too, where it can use an instruction for it).
template <typename V>
inline v16 Float(V q) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<V, i8x16>) {
    __m128i b;
    std::memcpy(&b, &q, sizeof(b));
    const __m512i i = _mm512_cvtepi8_epi32(b);
    i32x16 out;
    std::memcpy(&out, &i, sizeof(out));
    return __builtin_convertvector(out, v16);
  }
#endif
  return __builtin_convertvector(__builtin_convertvector(q, i32x16), v16);
}

// 16 float8_e4m3fn values (bits) -> floats, exactly: sign, 4 exponent bits (bias 7), 3 mantissa
// bits; exponent 0 is subnormal (m * 2^-9). NaN (0x7f, 0xff) is not decoded (no checkpoint has it).
inline v16 E4m3(u8x16 b) {
#ifdef __AVX512F__  // gcc scalarizes this widening here too
  __m128i raw;
  std::memcpy(&raw, &b, sizeof(raw));
  const __m512i wide = _mm512_cvtepu8_epi32(raw);
  i32x16 i;
  std::memcpy(&i, &wide, sizeof(i));
#else
  const i32x16 i = __builtin_convertvector(b, i32x16);
#endif
  const i32x16 e = (i >> 3) & 15, m = i & 7, sign = (i & 0x80) << 24;
  const i32x16 normal = sign | ((e + 120) << 23) | (m << 20);
  const v16 sub = __builtin_convertvector(m, v16) * (1.0f / 512);
  i32x16 sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub));
  const i32x16 bits = e == 0 ? (sub_bits | sign) : normal;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void Halves(const _Float16* p, v16 out[kNV]) {
  for (int v = 0; v < kNV; ++v) out[v] = Half(p + v * kW);
}

// MXFP4's e2m1 codes (sign bit 3, exponent bits 2..1, mantissa bit 0) -> their float32 values.
inline v16 E2m1(u8x16 c) {
  const i32x16 x = __builtin_convertvector(c, i32x16), e = (x >> 1) & 3, m = x & 1;
  const i32x16 normal = ((e + 126) << 23) | (m << 22), sub = m * (126 << 23);  // 1.m * 2^(e-1); 0 or 0.5
  const i32x16 is_normal = e != 0;
  const i32x16 bits = (normal & is_normal) | (sub & ~is_normal) | ((x & 8) << 28);
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// E8M0 exponents -> 2^(e - 127) in float32 (e = 0: the subnormal 2^-127).
inline v16 E8m0(u8x16 s) {
  const i32x16 e = __builtin_convertvector(s, i32x16);
  const i32x16 bits = (e << 23) | ((e == 0) & 0x00400000);
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Weights per block that shares one (d, m) pair of vectors in ForEachRow.
template <Format F>
constexpr int kSub = F == kQ6_K ? 16 : kBlock;

// Block b's scale (and offset: Q4's m, Q4_K's -dmin * min) vectors, d[kNV] and m[kNV].
template <Format F>
inline void BlockScales(const Panel& p, int64_t b, v16 d[kNV], v16 m[kNV]) {
  if constexpr (F == kQ4_K) {
    const int64_t sup = b / (kSuper / kBlock);
    for (int v = 0; v < kNV; ++v) {
      d[v] = Half(p.d + (2 * sup) * kPanel + v * kW) * Float(Load<u8x16>(p.s + (2 * b) * kPanel + v * kW));
      m[v] = -(Half(p.d + (2 * sup + 1) * kPanel + v * kW) * Float(Load<u8x16>(p.s + (2 * b + 1) * kPanel + v * kW)));
    }
  } else if constexpr (F == kQ6_K) {
    for (int v = 0; v < kNV; ++v)
      d[v] = Half(p.d + b / (kSuper / 16) * kPanel + v * kW) * Float(Load<i8x16>(p.s + b * kPanel + v * kW));
  } else if constexpr (F == kMXFP4) {
    for (int v = 0; v < kNV; ++v) d[v] = E8m0(Load<u8x16>(p.s + b * kPanel + v * kW));
  } else {
    Halves(p.d + b * kPanel, d);
    if constexpr (F == kQ4_1) Halves(p.m + b * kPanel, m);
  }
}

// Q6_K rows k and k + 1 (k even) of 16 columns at v: the 6-bit values - 32, as int8.
inline void Q6Pair(const uint8_t* q, int64_t k, int v, i8x16& lo, i8x16& hi) {
  const uint8_t* sb = q + k / kSuper * (192 * kPanel);
  const int64_t kk = k % kSuper;
  const u8x16 nib = Load<u8x16>(sb + kk / 2 * kPanel + v * kW);
  const u8x16 top = Load<u8x16>(sb + (128 + kk / 4) * kPanel + v * kW) >> (2 * (kk % 4));
  lo = (i8x16)((nib & 15) | (top & 3) << 4) - 32;
  hi = (i8x16)((nib >> 4) | (top & 12) << 2) - 32;
}

// Calls use(k, w) for k = k0..k1-1 in order (k0 and k1 multiples of kSub<F>, or K), w[kNV] the
// panel's row k decoded (int8: q, unscaled), and fence() between the two rows a Q4 byte holds.
// Each decoded vector is Opaque (vec.h): a decoded weight's scale is not folded into the FMAs.
// kDecoded: p.f holds rows k0..k1-1 only.
template <Format F, typename Use, typename Fence>
inline void ForEachRow(const Panel& p, int64_t k0, int64_t k1, Use&& use, Fence&& fence) {
  v16 w[kNV], hi[kNV], d[kNV], m[kNV];
  if constexpr (F == kDecoded) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int v = 0; v < kNV; ++v) w[v] = Load<v16>(p.f + (k - k0) * kPanel + v * kW);
      use(k, w);
    }
  } else if constexpr (F == kINT8 || F == kFP8) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int v = 0; v < kNV; ++v) {
        if constexpr (F == kINT8)
          w[v] = Float(Load<i8x16>(p.q + k * kPanel + v * kW));
        else
          w[v] = E4m3(Load<u8x16>(p.q + k * kPanel + v * kW));
        Opaque(w[v]);
      }
      use(k, w);
    }
  } else {
    constexpr bool kPairs = F != kQ8_0;  // two rows per byte (Q4, Q4_K) or per step (Q6_K)
    for (int64_t b = k0 / kSub<F>; b < k1 / kSub<F>; ++b) {
      BlockScales<F>(p, b, d, m);
      for (int64_t k = b * kSub<F>; k < (b + 1) * kSub<F>; k += kPairs ? 2 : 1) {
        for (int v = 0; v < kNV; ++v) {
          if constexpr (F == kQ4_1 || F == kQ4_K) {
            const u8x16 byte = Load<u8x16>(p.q + k / 2 * kPanel + v * kW);
            w[v] = Float(byte & 15) * d[v] + m[v];
            hi[v] = Float(byte >> 4) * d[v] + m[v];
            Opaque(hi[v]);
          } else if constexpr (F == kMXFP4) {
            const u8x16 byte = Load<u8x16>(p.q + k / 2 * kPanel + v * kW);
            w[v] = E2m1(byte & 15) * d[v];
            hi[v] = E2m1(byte >> 4) * d[v];
            Opaque(hi[v]);
          } else if constexpr (F == kQ6_K) {
            i8x16 lo, up;
            Q6Pair(p.q, k, v, lo, up);
            w[v] = Float(lo) * d[v];
            hi[v] = Float(up) * d[v];
            Opaque(hi[v]);
          } else {
            w[v] = Float(Load<i8x16>(p.q + k * kPanel + v * kW)) * d[v];
          }
          Opaque(w[v]);
        }
        use(k, w);
        if constexpr (kPairs) {
          fence();
          use(k + 1, hi);
        }
      }
    }
  }
}

}  // namespace jaxserve::quant_matmul
