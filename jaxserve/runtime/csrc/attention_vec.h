// Ragged paged attention's vector steps (csrc/attention_tiles.h's fast path): lane reductions,
// 16 page elements widened to float32 at a time, the quantized pages' scales, the scores' masks,
// and one online-softmax step over a run of 16-slot tiles.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention.h"
#include "page_types.h"
#include "vec.h"

namespace jaxserve::attention {

// A tile is kW (vec.h) slots: the floats of one v16.
using jaxserve::LoadU;  // float32's, beside the page types' below

// Lane reductions as shuffle trees (4 steps for 16 lanes).
template <typename F>
inline float Reduce(v16 x, F op) {
  using i16 = int32_t __attribute__((vector_size(64)));
  x = op(x, __builtin_shuffle(x, i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = op(x, __builtin_shuffle(x, i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  x = op(x, __builtin_shuffle(x, i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  x = op(x, __builtin_shuffle(x, i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return x[0];
}
inline float HSum(v16 x) { return Reduce(x, [](v16 a, v16 b) { return a + b; }); }
inline float HMax(v16 x) { return Reduce(x, [](v16 a, v16 b) { return a > b ? a : b; }); }

inline v16 LoadU(const Bf16* src) {
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  using u32x16 = uint32_t __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, src, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 x;
  std::memcpy(&x, &w, sizeof(x));
  return x;
}

// 16 bytes widened to 16 int32 lanes: one vpmovsxbd / vpmovzxbd where AVX-512 is there (GCC's
// generic byte -> int vector conversion is far slower).
template <bool Signed>
inline i32x16 WidenBytes(const void* src) {
  i32x16 out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(src));
  const __m512i w = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&out, &w, sizeof(out));
#else  // GCC drops vector_size on a dependent alias (std::conditional_t): spell out both types
  using s16 = int8_t __attribute__((vector_size(16)));
  using u16 = uint8_t __attribute__((vector_size(16)));
  if constexpr (Signed) {
    s16 b;
    std::memcpy(&b, src, sizeof(b));
    out = __builtin_convertvector(b, i32x16);
  } else {
    u16 b;
    std::memcpy(&b, src, sizeof(b));
    out = __builtin_convertvector(b, i32x16);
  }
#endif
  return out;
}

inline v16 LoadU(const int8_t* src) { return __builtin_convertvector(WidenBytes<true>(src), v16); }

// 16 fp8 values: ToFloat's arithmetic, lane-wise.
template <int M, int Bias>
inline v16 LoadU(const Fp8<M, Bias>* src) {
  const i32x16 i = WidenBytes<false>(src);
  const i32x16 m = i & ((1 << M) - 1), e = (i >> M) & ((1 << (7 - M)) - 1);
  const i32x16 mant = e == 0 ? m : m + (1 << M);
  const i32x16 pow_bits = ((e == 0 ? i32x16{} + 1 : e) + (127 - Bias - M)) << 23;
  v16 pow;
  std::memcpy(&pow, &pow_bits, sizeof(pow));
  const v16 v = __builtin_convertvector(mant, v16) * pow;
  return (i & 0x80) != 0 ? -v : v;
}

// Quantized pages: a tile's per-slot K scales multiply its scores; V scales multiply each visible
// probability [jlo, jhi] (the softmax sum l is taken before, over the unscaled probabilities).
template <typename T>
inline void ScaleScores(const Problem& p, int64_t blk, int64_t h, int64_t off, v16* sc, int n) {
  if constexpr (kQuant<T>) {
    const v16 s = LoadU(p.KScale(blk, h, off));
    for (int q = 0; q < n; ++q) sc[q] *= s;
  }
}
template <typename T>
inline void ScaleProbs(const Problem& p, int64_t blk, int64_t h, int64_t off, int64_t jlo, int64_t jhi, float* pr) {
  if constexpr (kQuant<T>) {
    const float* s = p.VScale(blk, h, off);
    for (int64_t c = jlo; c <= jhi; ++c) pr[c] *= s[c];
  }
}

// Each lane's slot number in a tile (0..15), for the visibility masks.
inline v16 Lanes() {
  v16 lane;
  for (int c = 0; c < kW; ++c) lane[c] = static_cast<float>(c);
  return lane;
}

// A tile's scores x for one query vector, soft-capped where the model caps them, and kNeg outside
// the visible slots [jlo, jhi] (slot: each lane's slot number, counted as jlo and jhi are).
inline v16 MaskScores(const Problem& p, v16 x, v16 slot, int64_t jlo, int64_t jhi) {
  if (p.soft_cap > 0.0f)
    for (int c = 0; c < kW; ++c) x[c] = p.soft_cap * std::tanh(x[c] / p.soft_cap);
  const auto vis = (slot >= static_cast<float>(jlo)) & (slot <= static_cast<float>(jhi));
  return vis ? x : v16{} + kNeg;
}

// One online-softmax step of a query vector over n tiles of masked scores in pr (MaskScores),
// vmax their lane-wise max: pr becomes the probabilities (zero where masked), the running max m and
// sum l are updated, and the accumulator acc[DV] is rescaled if m moved.
template <int DV>
inline void OnlineSoftmax(float* pr, int n, v16 vmax, float* m, float* l, v16* acc) {
  const float mx = std::max(*m, HMax(vmax));
  v16 sum{};
  for (int t = 0; t < n; ++t) {
    const v16 x = LoadU(pr + t * kW);
    const v16 ex = x == kNeg ? v16{} : Exp(x - mx);
    std::memcpy(pr + t * kW, &ex, sizeof(ex));
    sum += ex;
  }
  if (mx == *m) {  // the running max held (most steps once a row's max is seen): nothing rescales
    *l += HSum(sum);
    return;
  }
  const float corr = std::exp(*m - mx);
  *m = mx;
  *l = *l * corr + HSum(sum);
  for (int e = 0; e < DV; ++e) acc[e] *= corr;
}

// A 16-slot tile of one head as float32: float pages are used in place (K rows bs apart),
// bfloat16 pages are widened into the object's buffers (K rows 16 apart). Set points it at a tile.
template <int D, typename T>
struct Widened {
  alignas(64) float kbuf[D * kW];
  alignas(64) float vbuf[kW * D];
  const float* k = kbuf;
  const float* v = vbuf;
  int64_t k_stride = kW;
  void Set(const T* kt, const T* vt, int64_t bs) {
    for (int e = 0; e < D; ++e) {
      const v16 x = LoadU(kt + e * bs);
      std::memcpy(kbuf + e * kW, &x, sizeof(x));
    }
    for (int i = 0; i < kW * D; i += kW) {
      const v16 x = LoadU(vt + i);
      std::memcpy(vbuf + i, &x, sizeof(x));
    }
  }
};
template <int D>
struct Widened<D, float> {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_stride = 0;
  void Set(const float* kt, const float* vt, int64_t bs) { k = kt, v = vt, k_stride = bs; }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// Attribute isa 1 (bfloat16 pages, prefill items): scores and the probabilities' sums over V as
// AVX-512 BF16 dot products (vdpbf16ps: two products a lane), the query vectors and probabilities
// rounded to bfloat16 (to nearest even) as the pages' K and V already are; float32 accumulation.
// A 32-bit lane holds a pair: (element 2i, element 2i + 1) in its (low, high) halves.
using u32x16 = uint32_t __attribute__((vector_size(64)));

// Two runs of 16 bfloat16 values as 16 pairs (a[c], b[c]).
inline u32x16 PairUp(const Bf16* a, const Bf16* b) {
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  u16x16 lo, hi;
  std::memcpy(&lo, a, sizeof(lo));
  std::memcpy(&hi, b, sizeof(hi));
  return __builtin_convertvector(lo, u32x16) | (__builtin_convertvector(hi, u32x16) << 16);
}

// acc + sum over each lane's pair of a's and b's products.
inline v16 DotPairs(v16 acc, u32x16 a, u32x16 b) {
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}

// A 16-slot tile of one head as pairs: K's pairs of dims (kp[i]: dims 2i and 2i + 1 of the 16
// slots, from the transposed K block), V's pairs of slots (vp[c * DV + b]: slots 2c and 2c + 1,
// dims 16b..16b + 15). V slots at and past `valid` are zero: past the context a slot may hold
// anything, and a zero probability times a NaN would still be NaN.
template <int D>
struct PairedTile {
  static constexpr int DV = D / kW;
  alignas(64) u32x16 kp[D / 2];
  alignas(64) u32x16 vp[kW / 2 * DV];
  void Set(const Bf16* kt, const Bf16* vt, int64_t bs, int valid) {
    for (int i = 0; i < D / 2; ++i) kp[i] = PairUp(kt + 2 * i * bs, kt + (2 * i + 1) * bs);
    for (int c = 0; c < kW / 2; ++c)
      for (int b = 0; b < DV; ++b) {
        const u32x16 x = PairUp(vt + 2 * c * D + b * kW, vt + (2 * c + 1) * D + b * kW);
        const u32x16 keep_lo = 2 * c < valid ? u32x16{} + 0xffffu : u32x16{};
        const u32x16 keep_hi = 2 * c + 1 < valid ? u32x16{} + 0xffff0000u : u32x16{};
        vp[c * DV + b] = x & (keep_lo | keep_hi);
      }
  }
};
#else
// isa 1 is not built here: declared for TiledItem's discarded branches, never defined or called
using u32x16 = uint32_t __attribute__((vector_size(64)));
template <int D>
struct PairedTile;
v16 DotPairs(v16 acc, u32x16 a, u32x16 b);
#endif

}  // namespace jaxserve::attention
