// The dot-product matmul's work loop (csrc/dot_matmul.cc): a call's row chunks and panels over the
// thread pool, each row tile on the kernel of instruction set I (csrc/dot_tile.h, csrc/dot_amx.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "dot_amx.h"
#include "dot_amx_run.h"
#include "dot_matmul.h"
#include "dot_tile.h"
#include "parallel.h"
#include "row_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve::dot_matmul {

// Multiply<I> for format F.
template <Format F, Isa I>
void Run(xla::ffi::ThreadPool& pool, const Acts& a, const std::vector<int64_t>& group_rows, int64_t m_padded,
         int64_t panels, const Weight* ws, const Weight* ups, float* ys, const float* res) {
  // Rows per work item: AMX reads a panel's weights once per 16 rows, from L2 after the first.
  constexpr int64_t chunk = I == kAmx ? kAmxChunk : kRowChunk;
  constexpr int step = I == kAmx ? kAmxRows : kMaxMR<F>;
  static_assert(kAmxChunk % kAmxRows == 0, "AMX row tiles do not straddle chunks");
  static_assert(kRowChunk == kShareChunkRows, "the calls between matmuls follow their row shares (parallel.h)");
  // bf16 on AMX: its own work loop (csrc/dot_amx_run.h), on 32-row tiles
  const RowChunks chunks(group_rows.data(), int64_t(group_rows.size()),
                         I == kAmx && F == kBFLOAT16 ? 2 * kAmxRows : chunk);
  const int64_t n = panels * kPanel, m = chunks.rows();
  if (res)
    std::memcpy(ys + m * n, res + m * n, (m_padded - m) * n * sizeof(float));
  else
    std::memset(ys + m * n, 0, (m_padded - m) * n * sizeof(float));
#ifdef JAXSERVE_AMX
  if constexpr (I == kAmx && F == kBFLOAT16) return RunAmxBf16(pool, a, chunks, panels, ws, ups, ys, res);
#endif
  ForEachChunkPanel(pool, chunks, panels, [&](int64_t group, int64_t c0, int64_t rows, int64_t panel) {
    const Weight& w = ws[group];
    const Weight* up = ups ? ups + group : nullptr;
    int configured = 0;  // the rows the tiles are configured for (AMX)
    // w4a8 on AMX: the panel's nibbles split into bytes once per work item (gate, then up)
    thread_local AlignedVector<uint32_t> split[2];
    const uint32_t* panel_words[2] = {PanelWords<F>(w.w, panel, a.ldx), up ? PanelWords<F>(up->w, panel, a.ldx) : nullptr};
    if constexpr (I == kAmx && Nibbled(F))
      if (rows >= kAmxMinRowsW8A8)
        for (int i = 0; i < (up ? 2 : 1); ++i) {
          split[i].resize(a.ldx * kPanel);
          SplitNibbles<F>(panel_words[i], a.ldx / 2, split[i].data());
          panel_words[i] = split[i].data();
        }
    // The item's output lines, asked for with intent to write before its tiles are computed: a
    // line another core wrote last (XLA reuses buffers) then arrives while the tiles run.
    for (int64_t r = c0; r < c0 + rows; ++r)
      for (int64_t b = 0; b < kPanel; b += 16) __builtin_prefetch(ys + r * n + panel * kPanel + b, 1, 3);
    RowTiles<step>(c0, rows, up != nullptr, ys + panel * kPanel, n,
                   [&](int64_t mr, int64_t r, bool is_up, float* y, int64_t ldy) {
      const Weight& wt = is_up ? *up : w;
#ifdef JAXSERVE_AMX
      // The int8 formats' block sums are exact: a few rows run isa 1's kernel (faster there, the
      // same bits).
      if constexpr (I == kAmx && F != kBFLOAT16)
        if (mr < kAmxMinRowsW8A8) {
          for (int64_t j = 0; j < mr; j += kMaxMR<F>)
            Rows<F, kDot>(std::min<int64_t>(kMaxMR<F>, mr - j), a, r + j, wt, panel, y + j * ldy, ldy);
          return;
        }
      if constexpr (I == kAmx) {
        if (configured != mr) ConfigureTiles<F>(configured = int(mr));
        return AmxKernel<F>(a, r, int(mr), wt, panel_words[is_up], panel, y, ldy);
      }
#endif
      if constexpr (I != kAmx) Rows<F, I>(mr, a, r, wt, panel, y, ldy);
    });
    if (res) AddRows(res + c0 * n + panel * kPanel, rows, n, ys + c0 * n + panel * kPanel);
#ifdef JAXSERVE_AMX
    if (configured) _tile_release();  // the thread's tile state back to init (cheap context switches)
#endif
  });
}

// ys = x @ W, or silu(x @ W) * (x @ W_up) where `ups`, over row groups (group g: the next
// group_rows[g] rows, times ws[g] and ups[g]), plus res [m_padded, N] where given; the rows after
// the groups' (to m_padded) come out zero (or res's). Format f on instruction set I.
template <Isa I>
void Multiply(xla::ffi::ThreadPool& pool, Format f, const Acts& a, const std::vector<int64_t>& group_rows,
              int64_t m_padded, int64_t panels, const Weight* ws, const Weight* ups, float* ys, const float* res) {
  switch (f) {
    case kBFLOAT16: return Run<kBFLOAT16, I>(pool, a, group_rows, m_padded, panels, ws, ups, ys, res);
    case kW8A8: return Run<kW8A8, I>(pool, a, group_rows, m_padded, panels, ws, ups, ys, res);
    case kW4A8: return Run<kW4A8, I>(pool, a, group_rows, m_padded, panels, ws, ups, ys, res);
    case kQ8A8: return Run<kQ8A8, I>(pool, a, group_rows, m_padded, panels, ws, ups, ys, res);
    case kMXFP4A8: return Run<kMXFP4A8, I>(pool, a, group_rows, m_padded, panels, ws, ups, ys, res);
  }
}

}  // namespace jaxserve::dot_matmul
