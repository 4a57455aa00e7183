// The dot-product matmul's kernel on AMX tiles (csrc/dot_matmul.cc's isa 2: tdpbf16ps / tdpbsud
// on 16-row tiles of activations against 16-column tiles of the same panels as isa 1's).
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "dot_matmul.h"
#include "dot_tile.h"
#include "mxfp4a8.h"
#include "vec.h"

namespace jaxserve::dot_matmul {

// w4a8: the words of a panel's nibble rows (K / 8 of them) as w8a8's quad rows (K / 4) of bytes
// 0..15, what an AMX tile loads (it reads bytes, not nibbles); into `out`, K * 16 words. mxfp4a8:
// each byte through its table (2 e2m1 + 12).
template <Format F>
void SplitNibbles(const uint32_t* w, int64_t rows, uint32_t* out) {
  for (int64_t g = 0; g < rows; ++g)
    for (int v = 0; v < kNV; ++v) {
      i32x16 lo, hi;
      Nibbles(Load<i32x16>(w + g * kPanel + v * kW), lo, hi);
      if constexpr (F == kMXFP4A8) lo = jaxserve::mxfp4a8::Lookup(lo), hi = jaxserve::mxfp4a8::Lookup(hi);
      std::memcpy(out + 2 * g * kPanel + v * kW, &lo, sizeof(lo));
      std::memcpy(out + (2 * g + 1) * kPanel + v * kW, &hi, sizeof(hi));
    }
}

#ifdef JAXSERVE_AMX
// The tile shapes of one call (ldtilecfg's 64-byte operand, palette 1): tmm0-3 the 4 x 16
// float32 / int32 columns of a panel for `mr` rows, tmm4 the rows' activations (16 bf16 pairs or
// one W8A8 block: 8 quads), tmm5-7 the weights' tiles (16 k steps of 16 columns, 256 bytes apart).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <Format F>
void ConfigureTiles(int mr) {
  TileConfig cfg;
  const int steps = F == kBFLOAT16 ? 16 : kQuads;  // k words per tile: 32 bf16 k, or one 32-k block
  for (int t = 0; t < 4; ++t) cfg.rows[t] = mr, cfg.colsb[t] = 64;
  cfg.rows[4] = mr, cfg.colsb[4] = steps * 4;
  for (int t = 5; t < 8; ++t) cfg.rows[t] = steps, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// bf16 on more than 16 rows (2 x 2 blocking): tmm0-1 rows 0-15 and tmm2-3 rows 16..mr-1 of 32
// columns, tmm4-5 those rows' activations, tmm6-7 the weights' two 16-column tiles. Each k step's
// 4 tile loads feed 4 tdpbf16ps (the 16-row kernel: 5), and each weight tile serves 32 rows.
inline void ConfigureTiles2x2(int mr) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = mr - 16;
  _tile_loadconfig(&cfg);
}

// The accumulators tmm0-3 (a panel's 4 x 16 columns) to zero, and to memory (row stride in bytes).
inline void ZeroTiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

template <typename T>
inline void StoreTiles(T* dst, int64_t stride) {
  _tile_stored(0, dst, stride);
  _tile_stored(1, dst + 16, stride);
  _tile_stored(2, dst + 32, stride);
  _tile_stored(3, dst + 48, stride);
}

// One k step into tmm0-3: the rows' activations (tmm4, from x) times the panel's four 16-column
// weight tiles (tmm5-7 in turn, from w: 64 bytes apart, rows ldw apart). The tile macros take
// register numbers as tokens (no template constants), hence the instruction as a macro argument.
#define JAXSERVE_TILE_STEP(DOT)    \
  _tile_loadd(4, x, ldx);          \
  _tile_loadd(5, w, ldw);          \
  _tile_loadd(6, w + 64, ldw);     \
  DOT(0, 4, 5);                    \
  _tile_loadd(7, w + 128, ldw);    \
  DOT(1, 4, 6);                    \
  _tile_loadd(5, w + 192, ldw);    \
  DOT(2, 4, 7);                    \
  DOT(3, 4, 5)

template <Format F>
inline void TileStep(const char* x, int64_t ldx, const char* w, int64_t ldw) {
  if constexpr (F == kBFLOAT16) {
    JAXSERVE_TILE_STEP(_tile_dpbf16ps);
  } else {
    JAXSERVE_TILE_STEP(_tile_dpbsud);
  }
}
#undef JAXSERVE_TILE_STEP

// y[0:mr, 0:64] for one panel, 16 < mr <= 32, bf16 (ConfigureTiles2x2(mr) loaded): each 32-column
// half in turn, over all of k. Every 16 x 16 accumulator sees the same tdpbf16ps in the same k
// order as in AmxKernel's 16-row tiles, so the results are its bits.
inline void AmxKernel2x2(const Acts& a, int64_t r0, const uint32_t* wp, float* y, int64_t ldy) {
  const char* x0 = reinterpret_cast<const char*>(a.words.data() + r0 * a.ldx);
  const int64_t ldx = a.ldx * 4, ldw = kPanel * 4;
  const char* x1 = x0 + 16 * ldx;
  for (int h = 0; h < 2; ++h) {
    const char* w = reinterpret_cast<const char*>(wp) + h * 128;
    ZeroTiles();
    for (int64_t s = 0; s < a.ldx; s += 16) {
      _tile_loadd(4, x0 + s * 4, ldx);
      _tile_loadd(6, w + s * ldw, ldw);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, w + s * ldw + 64, ldw);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, x1 + s * 4, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* yh = y + h * 32;
    _tile_stored(0, yh, ldy * 4);
    _tile_stored(1, yh + 16, ldy * 4);
    _tile_stored(2, yh + 16 * ldy, ldy * 4);
    _tile_stored(3, yh + 16 * ldy + 16, ldy * 4);
  }
}

// y[0:mr, 0:64] for one panel, mr <= 16, on AMX tiles (ConfigureTiles<F>(mr) loaded), reading the
// panel's words at wp (w4a8: SplitNibbles' bytes). bf16: float32 sums over k in steps of 32. W8A8:
// per block of 32 k the exact int32 sum of xq (q + 128) (tdpbsud: signed activations, unsigned
// weights), less 128 sum xq, then as Kernel<kW8A8>; w4a8: the sum of xq q, then as Kernel<kW4A8>;
// mxfp4a8: the sum of xq (2 e2m1 + 12) less 12 sum xq, then as Kernel<kMXFP4A8>.
template <Format F>
void AmxKernel(const Acts& a, int64_t r0, int mr, const Weight& wt, const uint32_t* wp, int64_t panel, float* y,
               int64_t ldy) {
  const char* x = reinterpret_cast<const char*>(a.words.data() + r0 * a.ldx);
  const char* w = reinterpret_cast<const char*>(wp);
  const int64_t ldx = a.ldx * 4, ldw = kPanel * 4;
  ZeroTiles();
  if constexpr (F == kBFLOAT16) {
    for (int64_t s = 0; s < a.ldx; s += 16) TileStep<F>(x + s * 4, ldx, w + s * ldw, ldw);
    StoreTiles(y, ldy * 4);
    return;
  }
  alignas(64) int32_t c[kAmxRows][kPanel];
  alignas(64) float f[kAmxRows][kPanel] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    TileStep<F>(x + b * kBlock, ldx, w + b * kQuads * ldw, ldw);
    StoreTiles(c[0], sizeof(c[0]));
    ZeroTiles();
    const W4Scales dm = Blocked(F) ? W4Scales(wt, panel, a.blocks, b) : W4Scales{};
    const MxScales sc = F == kMXFP4A8 ? MxScales(wt, panel, a.blocks, b) : MxScales{};
    for (int r = 0; r < mr; ++r) {
      const float sx = a.sx[(r0 + r) * a.blocks + b];
      if constexpr (F == kMXFP4A8) {
        const i32x16 corr = i32x16{} - jaxserve::mxfp4a8::kOffset * a.xsum[(r0 + r) * a.blocks + b];
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = jaxserve::mxfp4a8::Block(Load<v16>(f[r] + v * kW), Load<i32x16>(c[r] + v * kW) + corr,
                                                  sc.s[v], sx);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
        continue;
      }
      if constexpr (Blocked(F)) {
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = W4Block(Load<v16>(f[r] + v * kW), Load<i32x16>(c[r] + v * kW), sx,
                                 a.xsum[(r0 + r) * a.blocks + b], dm.d[v], dm.m[v]);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
        continue;
      }
      const i32x16 corr = i32x16{} - 128 * a.xsum[(r0 + r) * a.blocks + b];
      for (int v = 0; v < kNV; ++v) {
        const i32x16 sum = Load<i32x16>(c[r] + v * kW) + corr;
        v16 fv = Load<v16>(f[r] + v * kW) + __builtin_convertvector(sum, v16) * sx;
        Opaque(fv);  // as Kernel<kW8A8>: block by block, in k order
        std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
      }
    }
  }
  for (int r = 0; r < mr; ++r)
    for (int v = 0; v < kNV; ++v) {
      v16 out = Load<v16>(f[r] + v * kW);
      if constexpr (!Blocked(F) && F != kMXFP4A8) out *= Load<v16>(wt.scale + panel * kPanel + v * kW);
      std::memcpy(y + r * ldy + v * kW, &out, sizeof(out));
    }
}
#endif

}  // namespace jaxserve::dot_matmul
