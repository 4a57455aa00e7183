// csrc/dot_matmul.cc's kMXFP4A8: gpt-oss's MXFP4 experts (runtime/mxfp4.py) times int8 activations
// (its kernels: csrc/dot_tile.h, csrc/dot_amx.h).
//
// A weight is an e2m1 code c (0..15) and its block's E8M0 exponent e: W = e2m1(c) * 2^(e - 127).
// 2 e2m1(c) is an integer in -12..12, so W = (2 e2m1(c)) * 2^(e - 128): an int8 value times the
// block's power of two. The kernel reads the codes in W4A8's nibble layout and turns each into the
// unsigned byte 2 e2m1(c) + 12 (0..24: the operand vpdpbusd / tdpbsud take unsigned) with a
// 16-entry table (vpshufb); each block's sum starts from -12 sum(xq), so it ends as the exact int32
// sum of xq (2 e2m1(c)), and is scaled in float32 by 2^(e - 128) sx (exact: a power of two) and
// added to the row's float32 sum, block by block in k order, on every path.
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "vec.h"

namespace jaxserve {
namespace mxfp4a8 {

constexpr int kOffset = 12;  // 2 e2m1 + 12 >= 0: the unsigned operand

// 2 e2m1(c) + 12 for the codes c = 0..15 (sign bit 3: codes 8..15 the negatives of 0..7).
constexpr uint8_t kTable[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// Bytes 0..15 (codes) -> their table bytes, 64 at a time.
inline i32x16 Lookup(i32x16 codes) {
#if defined(__AVX512BW__)
  __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kTable)));
  __m512i c;
  std::memcpy(&c, &codes, sizeof(c));
  const __m512i out = _mm512_shuffle_epi8(lut, c);  // per 128-bit lane: out[i] = lut[c[i] & 15]
  i32x16 r;
  std::memcpy(&r, &out, sizeof(r));
  return r;
#else
  uint8_t b[64];
  std::memcpy(b, &codes, sizeof(b));
  for (uint8_t& v : b) v = kTable[v & 15];
  i32x16 r;
  std::memcpy(&r, b, sizeof(r));
  return r;
#endif
}

// 16 columns' block scales 2^(e - 128) (the E8M0 exponents e, bytes) as float32, exact: normal
// numbers from e = 2, 2^-127 and 2^-128 (e = 1, 0) as subnormals.
inline v16 Scales(const uint8_t* e) {
  i32x16 x;
  for (int i = 0; i < 16; ++i) x[i] = e[i];
  const i32x16 bits = x >= 2 ? (x - 1) << 23 : i32x16{} + (1 << 21) << x;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One block's exact int32 sum (from -12 sum xq) into a row's float32 sum: f + sum * (2^(e-128) sx).
inline v16 Block(v16 f, i32x16 sum, v16 scale, float sx) {
  v16 t = __builtin_convertvector(sum, v16) * (scale * sx);  // scale * sx exact: one rounding
  Opaque(t);
  v16 out = f + t;
  Opaque(out);
  return out;
}

}  // namespace mxfp4a8
}  // namespace jaxserve
