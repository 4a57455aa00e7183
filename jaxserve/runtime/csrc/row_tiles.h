// A matmul work item's rows, one row tile at a time, for the three matmul kernels (csrc/matmul.cc,
// csrc/quant_matmul.cc, csrc/dot_matmul.cc): a plain layer's tiles go straight to y; a gated
// layer's gate and up tiles go to buffers and come out as silu(g) * u, applied to each tile as it
// is computed (one call, no [M, N] intermediates, no separate elementwise pass).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "formats.h"
#include "vec.h"

namespace jaxserve {

// y[r, 0:64] = silu(g[r]) * u[r] = g * sigmoid(g) * u for the rows r < rows of a tile (g and u
// rows kPanel apart, y rows ldy apart).
inline void SiluMul(const float* g, const float* u, int64_t rows, float* y, int64_t ldy) {
  for (int64_t j = 0; j < rows; ++j)
    for (int v = 0; v < kPanel; v += kW) {
      const v16 gv = Load<v16>(g + j * kPanel + v), uv = Load<v16>(u + j * kPanel + v);
      const v16 out = gv * uv / (1.0f + Exp(-gv));  // silu(g) * u
      std::memcpy(y + j * ldy + v, &out, sizeof(out));
    }
}

// y[r, 0:64] += res[r, 0:64] for the rows r < rows (both rows ld apart): a residual added to a
// panel's tile right after it is written (format_matmul.h's RowFusion), while it is in L1.
inline void AddRows(const float* res, int64_t rows, int64_t ld, float* y) {
  for (int64_t j = 0; j < rows; ++j)
    for (int v = 0; v < kPanel; v += kW) {
      const v16 out = Load<v16>(y + j * ld + v) + Load<v16>(res + j * ld + v);
      std::memcpy(y + j * ld + v, &out, sizeof(out));
    }
}

// Rows [r0, r0 + rows) of one panel's columns, Step rows a tile (the last one shorter):
// tile(mr, r, up, dst, ldd) writes rows r .. r + mr - 1 of x times the weight (up: the up weight)
// to dst, rows ldd apart. y: the panel's first column of row 0, rows ldy apart.
template <int Step, typename TileFn>
inline void RowTiles(int64_t r0, int64_t rows, bool gated, float* y, int64_t ldy, TileFn&& tile) {
  for (int64_t r = r0; r < r0 + rows; r += Step) {
    const int64_t mr = std::min<int64_t>(Step, r0 + rows - r);
    if (!gated) {
      tile(mr, r, false, y + r * ldy, ldy);
      continue;
    }
    alignas(64) float g[Step * kPanel], u[Step * kPanel];
    tile(mr, r, false, g, int64_t{kPanel});
    tile(mr, r, true, u, int64_t{kPanel});
    SiluMul(g, u, mr, y + r * ldy, ldy);
  }
}

}  // namespace jaxserve
