// The bf16 matmul's work loop on AMX tiles (csrc/dot_run.h's Run<kBFLOAT16, kAmx>): work items of
// one row tile (up to 32 rows, within a row group) times a few consecutive weight panels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dot_amx.h"
#include "dot_matmul.h"
#include "dot_tile.h"
#include "parallel.h"
#include "row_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve::dot_matmul {

#ifdef JAXSERVE_AMX
// Panels per work item: up to 8 (a 32-row tile's output then goes out in runs of 2 KiB per row, not
// 256-byte pieces 4 N bytes apart that crowd a few L1 sets when N is a multiple of 1024: 576 x 1536
// single-threaded +15%), as many as keep the panels' weights within about 1 MiB of L2 (K = 1536: 5),
// fewer while that would leave under 16 work items for the threads to share. Gated: up to 2 (its
// output goes out through SiluMul's vector stores, not tile stores; 576 x 1536 at M = 512 single-
// threaded: 8 panels 2.26-2.30 ms, 2 panels 2.10-2.11 ms).
inline int64_t AmxPanelsPerItem(int64_t tiles, int64_t panels, int64_t k_words, bool gated) {
  const int64_t in_l2 = (int64_t{1} << 20) / (k_words * kPanel * 4);
  return std::clamp<int64_t>(std::min(in_l2, tiles * panels / 16), 1, gated ? 2 : 8);
}

// Row tiles fastest within a group of panels: the group's weights (8 panels: 1 KiB per k) stay in L2
// while the row tiles pass; a tile's activations (32 rows) are read again from L1 or L2 per panel.
inline void RunAmxBf16(xla::ffi::ThreadPool& pool, const Acts& a, const RowChunks& tiles, int64_t panels,
                       const Weight* ws, const Weight* ups, float* ys, const float* res) {
  const int64_t n = panels * kPanel, t = tiles.size(), per = AmxPanelsPerItem(t, panels, a.ldx, ups != nullptr);
  const int64_t groups = (panels + per - 1) / per;
  ParallelFor(pool, t * groups, [&](int64_t i) {
    int64_t group, r0, mr;
    tiles.At(i % t, group, r0, mr);
    const int64_t p0 = i / t * per, p1 = std::min(panels, p0 + per);
    const Weight* up = ups ? ups + group : nullptr;
    // mr > 16: the 2 x 2 blocking (AmxKernel2x2); else AmxKernel's 16-row tile (decode's few rows)
    if (mr > kAmxRows) ConfigureTiles2x2(int(mr)); else ConfigureTiles<kBFLOAT16>(int(mr));
    const auto tile = [&](const Weight& w, int64_t panel, float* y, int64_t ldy) {
      const uint32_t* wp = PanelWords<kBFLOAT16>(w.w, panel, a.ldx);
      if (mr > kAmxRows) return AmxKernel2x2(a, r0, wp, y, ldy);
      AmxKernel<kBFLOAT16>(a, r0, int(mr), w, wp, panel, y, ldy);
    };
    for (int64_t p = p0; p < p1; ++p) {
      float* y = ys + r0 * n + p * kPanel;
      if (!up) {
        tile(ws[group], p, y, n);
      } else {
        alignas(64) float g[2 * kAmxRows * kPanel], u[2 * kAmxRows * kPanel];
        tile(ws[group], p, g, kPanel);
        tile(*up, p, u, kPanel);
        SiluMul(g, u, mr, y, n);
      }
      if (res) AddRows(res + r0 * n + p * kPanel, mr, n, y);
    }
    _tile_release();  // the thread's tile state back to init (cheap context switches)
  });
}
#endif

}  // namespace jaxserve::dot_matmul
