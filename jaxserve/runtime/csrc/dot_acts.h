// The dot-product matmul's activations (csrc/dot_matmul.cc), prepared once per call for all its
// rows: bfloat16 pairs, or int8 quads quantized in blocks of 32 along k with each block's scale and sum.
// The rows are read through an XRows (csrc/x_rows.h): a grouped call's row order is applied here,
// and the kernels read the prepared rows in sorted order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dot_matmul.h"
#include "format_matmul.h"
#include "parallel.h"
#include "vec.h"
#include "x_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve::dot_matmul {

// Row r of x into a's words (and w8a8's block scales and sums).
inline void PrepareRow(Format f, const float* xr, Acts& a, int64_t r) {
  uint32_t* out = a.words.data() + r * a.ldx;
  if (f == kBFLOAT16) {  // the words' halves are the bf16 values in k order (vec.h RoundBf16Pairs)
    RoundBf16Pairs(xr, 2 * a.ldx, out);
    return;
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* xb = xr + b * kBlock;
    float amax = 0;
    for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int8_t q[kBlock];
    int32_t sum = 0;
    for (int k = 0; k < kBlock; ++k) {
      q[k] = int8_t(std::clamp(std::nearbyint(xb[k] * inv), -127.0f, 127.0f));
      sum += q[k];
    }
    std::memcpy(out + b * kQuads, q, sizeof(q));  // word i, byte t = x[4 i + t] (little-endian)
    a.sx[r * a.blocks + b] = amax / 127.0f;
    a.xsum[r * a.blocks + b] = sum;
  }
}

// Row xr RMS-normed into out (format_matmul.h's RowFusion): xr * (1 / sqrt(mean(xr^2) + eps)) *
// scale, each product in float32 as the model's RMSNorm (model/layers.py) takes them; the mean's sum
// runs over 16 lanes, so it may differ from XLA's in the last bit.
inline const float* NormRow(const float* xr, int64_t k_len, const RowFusion& fu, float* out) {
  v16 sq{};
  int64_t k = 0;
  for (; k + kW <= k_len; k += kW) {
    const v16 v = LoadU(xr + k);
    sq += v * v;
  }
  float ss = 0;
  for (int i = 0; i < kW; ++i) ss += sq[i];
  for (; k < k_len; ++k) ss += xr[k] * xr[k];
  const float r = 1.0f / std::sqrt(ss / float(k_len) + fu.eps);
  for (k = 0; k < k_len; ++k) out[k] = xr[k] * r * fu.norm[k];
  return out;
}

// x's first m rows (RMS-normed first where fu has a norm), a few rows per work item (prefill's
// thousands of rows are worth the threads).
inline void Prepare(xla::ffi::ThreadPool& pool, Format f, const XRows& x, int64_t m, const RowFusion& fu, Acts& a) {
  constexpr int64_t kRows = 16;
  const int64_t k_len = x.k_len;
  a.ldx = k_len / (f == kBFLOAT16 ? 2 : 4);
  a.blocks = f == kBFLOAT16 ? 0 : k_len / kBlock;
  // Grown, never shrunk: a resize that grows value-initializes (a memset on the caller's core of
  // lines the other core's share then writes).
  if (a.words.size() < size_t(m * a.ldx)) a.words.resize(m * a.ldx);
  if (a.sx.size() < size_t(m * a.blocks)) a.sx.resize(m * a.blocks), a.xsum.resize(m * a.blocks);
  // Row blocks in shares by CPU, as the matmul's row chunks (ParallelShares): a core converts about
  // the rows it then multiplies.
  ParallelShares(pool, (m + kRows - 1) / kRows, 1, [&](int64_t i, int64_t) {
    thread_local std::vector<float> normed;
    if (fu.norm) normed.resize(k_len);
    for (int64_t r = i * kRows; r < std::min(m, (i + 1) * kRows); ++r)
      PrepareRow(f, fu.norm ? NormRow(x(r), k_len, fu, normed.data()) : x(r), a, r);
  });
}

}  // namespace jaxserve::dot_matmul
