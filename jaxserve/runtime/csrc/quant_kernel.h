// The quantized-weight matmul's kernel (csrc/quant_matmul.cc's formats and calls): y = x @ W (or the
// gated product) over a call's row chunks and weight panels.
//
// Why: decoding streams every weight once per step, so bytes per weight bound its speed. Each
// k-row of a panel (64 weights) is decoded in registers into four 16-lane float vectors right
// before the FMAs that use it, so memory traffic is that of the packed form, and the arithmetic
// is the float32 kernel's: y[i, j] sums x[i, k] * W[k, j] over k = 0..K-1 in order, whatever M is
// and however the work is split. Plain vector extensions: the compiler uses the widest the build
// targets (-march=native, per machine, see cpu_kernels.py), no instruction set is assumed here.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "quant_decode.h"
#include "row_tiles.h"
#include "vec.h"
#include "x_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve::quant_matmul {

constexpr int kMR = 6, kRowChunk = 48;

// A quantized weight as the kernel reads it: base pointers and per-panel strides.
struct Weight {
  const uint8_t* q;
  const void* d;  // int8: f32 scale[N]; else f16[P, K / 32, 64]
  const _Float16* m;
  Panel At(int64_t panel, int64_t k_len, Format f) const {
    if (f == kINT8 || f == kFP8) return {q + panel * k_len * kPanel, nullptr, nullptr};
    if (f == kMXFP4) {  // the exponents (bytes) in s
      Panel p{q + panel * k_len / 2 * kPanel, nullptr, nullptr};
      p.s = static_cast<const uint8_t*>(d) + panel * k_len / kBlock * kPanel;
      return p;
    }
    if (f == kQ4_K || f == kQ6_K) {  // m holds the sub-blocks' integer scales
      const int64_t qs = (f == kQ4_K ? k_len / 2 : k_len / kSuper * 192) * kPanel;
      const int64_t ds = k_len / kSuper * (f == kQ4_K ? 2 : 1) * kPanel;
      const int64_t ss = f == kQ4_K ? k_len / kBlock * 2 * kPanel : k_len / 16 * kPanel;
      Panel p{q + panel * qs, static_cast<const _Float16*>(d) + panel * ds, nullptr};
      p.s = reinterpret_cast<const uint8_t*>(m) + panel * ss;
      return p;
    }
    const int64_t qs = f == kQ4_1 ? k_len / 2 * kPanel : k_len * kPanel, ds = k_len / kBlock * kPanel;
    return {q + panel * qs, static_cast<const _Float16*>(d) + panel * ds, m ? m + panel * ds : nullptr};
  }
  const float* Scale(int64_t panel, Format f) const {
    return f == kINT8 || f == kFP8 ? static_cast<const float*>(d) + panel * kPanel : nullptr;
  }
};

// out[k1 - k0, 64] = the panel's rows k0..k1-1 decoded (int8: q, unscaled): what the row tiles of
// a chunk share.
template <Format F>
void Decode(const Panel& p, int64_t k0, int64_t k1, float* out) {
  ForEachRow<F>(p, k0, k1, [&](int64_t k, const v16* w) {
    std::memcpy(out + (k - k0) * kPanel, w, kNV * sizeof(v16));
  }, [] {});
}

// y[0:MR, 0:64] = c + x[r0:r0 + MR, k0:k1] @ panel[k0:k1] (c: rows ldc apart, or zero where null),
// times `scale` per column where given (int8); y rows ldy apart. The sums go on in k order from the
// c they are given, so k ranges run one after another sum as one whole-K call.
template <Format F, int MR>
void Kernel(const XRows& xs, int64_t r0, const Panel& p, int64_t k0, int64_t k1, const float* c0, int64_t ldc,
            const float* scale, float* y, int64_t ldy) {
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = xs(r0 + r);
  v16 c[MR][kNV] = {};
  if (c0)
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kNV; ++v) c[r][v] = Load<v16>(c0 + r * ldc + v * kW);
  ForEachRow<F>(p, k0, k1, [&](int64_t k, const v16* w) {
    for (int r = 0; r < MR; ++r) {
      const float a = x[r][k];
      for (int v = 0; v < kNV; ++v) c[r][v] += a * w[v];
    }
  }, [&] {  // k's products summed before k + 1's, not the two added together first
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kNV; ++v) Opaque(c[r][v]);
  });
  if (scale)
    for (int v = 0; v < kNV; ++v) {
      const v16 s = Load<v16>(scale + v * kW);
      for (int r = 0; r < MR; ++r) c[r][v] *= s;
    }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) std::memcpy(y + r * ldy + v * kW, &c[r][v], sizeof(v16));
}

template <Format F>
void Tile(int64_t mr, const XRows& xs, int64_t r0, const Panel& p, int64_t k0, int64_t k1, const float* c0,
          int64_t ldc, const float* scale, float* y, int64_t ldy) {
  switch (mr) {
    case 1: return Kernel<F, 1>(xs, r0, p, k0, k1, c0, ldc, scale, y, ldy);
    case 2: return Kernel<F, 2>(xs, r0, p, k0, k1, c0, ldc, scale, y, ldy);
    case 3: return Kernel<F, 3>(xs, r0, p, k0, k1, c0, ldc, scale, y, ldy);
    case 4: return Kernel<F, 4>(xs, r0, p, k0, k1, c0, ldc, scale, y, ldy);
    case 5: return Kernel<F, 5>(xs, r0, p, k0, k1, c0, ldc, scale, y, ldy);
    case 6: return Kernel<F, 6>(xs, r0, p, k0, k1, c0, ldc, scale, y, ldy);
    default: return;
  }
}
static_assert(kMR == 6, "Tile covers MR = 1..6");

// k rows per decoded slab: 128 x 64 floats (32 KiB) stay in L1 while every row tile of a chunk
// reads them (a whole decoded panel, 256 KiB at K = 1024, was read from L2 by each tile); a
// multiple of every format's block (kSub), so slabs start on block boundaries.
constexpr int64_t kSlab = 128;

// A chunk of more than one row tile: the panel decoded once per chunk, a slab of k at a time, into
// this thread's buffer, and the kernel run over the floats: the same values, summed in the same
// order (each tile's sums carried from slab to slab in `acc`), decoded 1 / 8 as often as per tile.
// Rows r0..r0+rows-1 of y's panel columns (y rows n apart; gated: silu(g) * u).
template <Format F>
void SharedDecode(const XRows& xs, int64_t r0, int64_t rows, const Panel* ps, const float* const* scales, int weights,
                  float* y, int64_t n) {
  const int64_t k_len = xs.k_len;
  thread_local std::vector<float> buf, acc;
  buf.resize(kSlab * kPanel);
  acc.resize(weights * rows * kPanel);
  for (int64_t k0 = 0; k0 < k_len; k0 += kSlab) {
    const int64_t k1 = std::min(k_len, k0 + kSlab);
    for (int u = 0; u < weights; ++u) {
      Decode<F>(ps[u], k0, k1, buf.data());
      Panel decoded{};
      decoded.f = buf.data();
      // One weight: straight into y. Gated: gate and up into acc, then silu(g) * u.
      float* c = weights == 1 ? y + r0 * n : acc.data() + u * rows * kPanel;
      const int64_t ldc = weights == 1 ? n : kPanel;
      for (int64_t r = 0; r < rows; r += kMR)
        Tile<kDecoded>(std::min<int64_t>(kMR, rows - r), xs, r0 + r, decoded, k0, k1, k0 ? c + r * ldc : nullptr,
                       ldc, k1 == k_len ? scales[u] : nullptr, c + r * ldc, ldc);
    }
  }
  if (weights == 2) SiluMul(acc.data(), acc.data() + rows * kPanel, rows, y + r0 * n, n);
}

// ys = xs @ W, or silu(xs @ W) * (xs @ W_up) where `ups`, over `chunks`' row groups: group g's rows
// times ws[g] (and ups[g]); the rows after the groups' (to m_padded) come out zero.
template <Format F>
void Run(xla::ffi::ThreadPool& pool, const XRows& xs, const RowChunks& chunks, int64_t m_padded, int64_t panels,
         const Weight* ws, const Weight* ups, float* ys) {
  const int64_t n = panels * kPanel, m = chunks.rows(), k_len = xs.k_len;
  std::memset(ys + m * n, 0, (m_padded - m) * n * sizeof(float));
  ForEachChunkPanel(pool, chunks, panels, [&](int64_t group, int64_t r0, int64_t rows, int64_t panel) {
    const Weight& w = ws[group];
    const Weight* w_up = ups ? ups + group : nullptr;
    const Panel ps[2] = {w.At(panel, k_len, F), w_up ? w_up->At(panel, k_len, F) : Panel{}};
    const float* scales[2] = {w.Scale(panel, F), w_up ? w_up->Scale(panel, F) : nullptr};
    if (rows > kMR) return SharedDecode<F>(xs, r0, rows, ps, scales, w_up ? 2 : 1, ys + panel * kPanel, n);
    RowTiles<kMR>(r0, rows, w_up != nullptr, ys + panel * kPanel, n,
                  [&](int64_t mr, int64_t r, bool up, float* y, int64_t ldy) {
                    Tile<F>(mr, xs, r, ps[up], 0, k_len, nullptr, 0, scales[up], y, ldy);
                  });
  });
}

// Run<F> for format f.
inline void Multiply(xla::ffi::ThreadPool& pool, Format f, const XRows& xs, const RowChunks& chunks, int64_t m_padded,
                     int64_t panels, const Weight* ws, const Weight* ups, float* ys) {
  switch (f) {
    case kINT8: return Run<kINT8>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
    case kQ8_0: return Run<kQ8_0>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
    case kQ4_1: return Run<kQ4_1>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
    case kFP8: return Run<kFP8>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
    case kQ4_K: return Run<kQ4_K>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
    case kQ6_K: return Run<kQ6_K>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
    case kMXFP4: return Run<kMXFP4>(pool, xs, chunks, m_padded, panels, ws, ups, ys);
  }
}

}  // namespace jaxserve::quant_matmul
