// The dot-product matmul's kernels on portable vector code and on the AVX-512 dot-product
// instructions (csrc/dot_matmul.cc's isa 0 and 1; AMX's, isa 2: csrc/dot_amx.h): an MR x 64 tile
// of y for one panel, its k steps on one instruction set.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "dot_matmul.h"
#include "mxfp4a8.h"
#include "vec.h"

namespace jaxserve::dot_matmul {

// w4a8: a word of nibbles as its low quad and its high quad of bytes 0..15.
inline void Nibbles(i32x16 b, i32x16& lo, i32x16& hi) {
  lo = b & 0x0f0f0f0f;
  hi = (b >> 4) & 0x0f0f0f0f;
}

// Where panel `panel` of weight words `w` starts: K / per rows of 64 words (w4a8: a row holds 8 k).
template <Format F>
inline const uint32_t* PanelWords(const uint32_t* w, int64_t panel, int64_t k_words) {
  return w + panel * (Nibbled(F) ? k_words / 2 : k_words) * kPanel;
}

// One step of a tile: the 64 columns' accumulators of MR rows. Each k step (a pair for bf16, a
// quad for w8a8) reads 4 vectors of the panel and one 32-bit word of each row's activations.
template <Format F, Isa I, int MR>
struct Tile {
  using Acc = std::conditional_t<F == kBFLOAT16, v16, i32x16>;
  Acc c[MR][kNV];  // each path sets it before its sums (zeroing it here cost a 1.5 KB memset a call:
                   // the compiler kept the array in memory for it)

  // k steps s0..s1 (w4a8: steps of two quads, one row of nibbles, the low ones first).
  void Run(const uint32_t* x, const uint32_t* w, int64_t s0, int64_t s1, int64_t ldx) {
    for (int64_t s = s0; s < s1; ++s) {
      i32x16 b[kNV];
      for (int v = 0; v < kNV; ++v) b[v] = Load<i32x16>(w + s * kPanel + v * kW);
      if constexpr (Nibbled(F)) {
        i32x16 hi[kNV];
        for (int v = 0; v < kNV; ++v) Nibbles(b[v], b[v], hi[v]);
        if constexpr (F == kMXFP4A8)
          for (int v = 0; v < kNV; ++v) b[v] = jaxserve::mxfp4a8::Lookup(b[v]), hi[v] = jaxserve::mxfp4a8::Lookup(hi[v]);
        for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + 2 * s], b);
        for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + 2 * s + 1], hi);
      } else {
        for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + s], b);
      }
    }
  }

  inline void Step(int r, uint32_t a, const i32x16* b) {
    if constexpr (F == kBFLOAT16 && I == kDot && kHaveBf16) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a));
      for (int v = 0; v < kNV; ++v)
        c[r][v] = Bits<v16>(_mm512_dpbf16_ps(Bits<__m512>(c[r][v]), av, Bits<__m512bh>(b[v])));
    } else if constexpr (F == kBFLOAT16) {  // vdpbf16ps' order: the odd k of the pair, then the even one
      const float lo = Bits<float>(a << 16), hi = Bits<float>(a & 0xffff0000u);
      for (int v = 0; v < kNV; ++v) {
        c[r][v] += hi * Bits<v16>(b[v] & int32_t(0xffff0000u));
        Opaque(c[r][v]);
        c[r][v] += lo * Bits<v16>(b[v] << 16);
        Opaque(c[r][v]);
      }
    } else if constexpr (I == kDot && kHaveVnni) {  // unsigned weights (q + 128, or q4) times signed x
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a));
      for (int v = 0; v < kNV; ++v)
        c[r][v] = Bits<i32x16>(_mm512_dpbusd_epi32(Bits<__m512i>(c[r][v]), Bits<__m512i>(b[v]), av));
    } else {  // exact integers: any order gives the same sum
      for (int t = 0; t < 4; ++t) {
        const int32_t xt = int32_t(a << (24 - 8 * t)) >> 24;
        for (int v = 0; v < kNV; ++v) c[r][v] += xt * ((b[v] >> (8 * t)) & 255);
      }
    }
  }
};

// mxfp4a8: a block's scales 2^(e - 128) for a panel's 64 columns.
struct MxScales {
  v16 s[kNV];
  MxScales() = default;
  MxScales(const Weight& wt, int64_t panel, int64_t blocks, int64_t b) {
    for (int v = 0; v < kNV; ++v) s[v] = jaxserve::mxfp4a8::Scales(wt.e + (panel * blocks + b) * kPanel + v * kW);
  }
};

// w4a8, q8a8: a block's d and m for a panel's 64 columns (f16 -> float32, once per block, not per row).
struct W4Scales {
  v16 d[kNV], m[kNV];
  W4Scales() = default;
  W4Scales(const Weight& wt, int64_t panel, int64_t blocks, int64_t b) {
    for (int v = 0; v < kNV; ++v)
      d[v] = Half(wt.d + (panel * blocks + b) * kPanel + v * kW), m[v] = Half(wt.m + (panel * blocks + b) * kPanel + v * kW);
  }
};

// w4a8, q8a8: one block's sum into a row's float32 sum, f + sx (d sum(xq q) + m sum(xq)), for 16 columns.
inline v16 W4Block(v16 f, i32x16 sum, float sx, int32_t xsum, v16 d, v16 m) {
  v16 t = d * __builtin_convertvector(sum, v16) + m * float(xsum);
  Opaque(t);
  v16 out = f + t * sx;
  Opaque(out);  // block by block, in k order, on every path
  return out;
}

// y[0:MR, 0:64] for one panel. bf16: the tile's float32 sums. w8a8: per block of 32 k, the exact
// int32 sum of (q + 128) xq from -128 sum xq, times the block's sx, added to a float32 sum in
// block order; then times scale[n].
template <Format F, Isa I, int MR>
void Kernel(const Acts& a, int64_t r0, const Weight& wt, int64_t panel, float* y, int64_t ldy) {
  const uint32_t* x = a.words.data() + r0 * a.ldx;
  const uint32_t* w = PanelWords<F>(wt.w, panel, a.ldx);
  Tile<F, I, MR> t;
  if constexpr (F == kBFLOAT16) {  // the sums are t's
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kNV; ++v) t.c[r][v] = v16{};
    t.Run(x, w, 0, a.ldx, a.ldx);
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kNV; ++v) std::memcpy(y + r * ldy + v * kW, &t.c[r][v], sizeof(v16));
    return;
  }
  alignas(64) float f[MR][kPanel] = {};
  if constexpr (F == kMXFP4A8) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < kNV; ++v)
          t.c[r][v] = i32x16{} - jaxserve::mxfp4a8::kOffset * a.xsum[(r0 + r) * a.blocks + b];
      t.Run(x, w, b * (kQuads / 2), (b + 1) * (kQuads / 2), a.ldx);
      const MxScales sc(wt, panel, a.blocks, b);
      for (int r = 0; r < MR; ++r) {
        const float sx = a.sx[(r0 + r) * a.blocks + b];
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = jaxserve::mxfp4a8::Block(Load<v16>(f[r] + v * kW), t.c[r][v], sc.s[v], sx);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
      }
      asm("" ::: "memory");
    }
  } else if constexpr (Blocked(F)) {
    constexpr int steps = F == kW4A8 ? kQuads / 2 : kQuads;  // k steps per block (w4a8: of two quads)
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < kNV; ++v) t.c[r][v] = i32x16{};
      t.Run(x, w, b * steps, (b + 1) * steps, a.ldx);
      const W4Scales dm(wt, panel, a.blocks, b);
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (r0 + r) * a.blocks + b;
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = W4Block(Load<v16>(f[r] + v * kW), t.c[r][v], a.sx[at], a.xsum[at], dm.d[v], dm.m[v]);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
      }
      asm("" ::: "memory");
    }
  } else if constexpr (F != kBFLOAT16) {  // w8a8
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < kNV; ++v) t.c[r][v] = i32x16{} - 128 * a.xsum[(r0 + r) * a.blocks + b];
      t.Run(x, w, b * kQuads, (b + 1) * kQuads, a.ldx);
      for (int r = 0; r < MR; ++r) {
        const float sx = a.sx[(r0 + r) * a.blocks + b];
        for (int v = 0; v < kNV; ++v) {
          v16 fv = Load<v16>(f[r] + v * kW) + __builtin_convertvector(t.c[r][v], v16) * sx;
          Opaque(fv);  // block by block, in k order, for every MR
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
      }
      asm("" ::: "memory");  // keep f in memory: its 24 vectors would not fit in registers beside t.c
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) {
      v16 out;
      if constexpr (Blocked(F) || F == kMXFP4A8)
        out = Load<v16>(f[r] + v * kW);
      else
        out = Load<v16>(f[r] + v * kW) * Load<v16>(wt.scale + panel * kPanel + v * kW);
      std::memcpy(y + r * ldy + v * kW, &out, sizeof(out));
    }
}

// Kernel<MR> for any 0 < MR <= kMaxMR<F>.
template <Format F, Isa I, int MR = 1>
void Rows(int64_t mr, const Acts& a, int64_t r0, const Weight& wt, int64_t panel, float* y, int64_t ldy) {
  if constexpr (MR <= kMaxMR<F>) {
    if (mr == MR) return Kernel<F, I, MR>(a, r0, wt, panel, y, ldy);
    Rows<F, I, MR + 1>(mr, a, r0, wt, panel, y, ldy);
  }
}

}  // namespace jaxserve::dot_matmul
