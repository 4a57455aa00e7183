// Ragged paged attention's problem (csrc/paged_attention.cc: the contract and the page layout):
// a call's operands as the kernels read them, its work items, and the item functions per page
// element type (csrc/attention_tiles.h's kernels, built by attention_float.cc for float32 and
// bfloat16 pages and by attention_quant.cc for int8 and fp8 pages, side by side).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>

#include "page_types.h"
#include "rope.h"
#include "vec.h"

namespace jaxserve::attention {

constexpr float kNeg = -1e30f;  // "no score yet"; finite so fast-math cannot break the logic

// Whether this build has isa 1, bfloat16 pages' scores and sums as AVX-512 BF16 dot products
// (csrc/attention_vec.h PairedTile); the portable float32 FMAs are isa 0.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHaveDotBf16 = true;
#else
constexpr bool kHaveDotBf16 = false;
#endif

struct Problem {
  const float* q;
  const void* k;  // float or Bf16, per the pages' dtype
  const void* v;
  float* out;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* block_tables;
  int64_t max_blocks, num_blocks, block_size, hq, hkv, d;
  float scale, soft_cap;
  int64_t window;  // 0: none
  const float* ks = nullptr;  // quantized pages: per-(slot, head) scales, per block [Hkv][bs]
  const float* vs = nullptr;
  const float* sinks = nullptr;  // attention sinks: a logit per query head [Hq], or none
  Rope rope;  // the layer's RoPE, applied to q as it is loaded (csrc/rope.h), or none
  int64_t isa = 0;  // attribute isa: 1 bfloat16 pages' scores and sums as dot products (attention_vec.h)

  // Query vector (token t, query head qh), rotated by the call's RoPE, times `mul`, into dst[0, d).
  void LoadQ(int64_t t, int64_t qh, float mul, float* dst) const {
    const float* src = q + (t * hq + qh) * d;
    if (rope.rot == 0) {
      for (int64_t e = 0; e < d; ++e) dst[e] = src[e] * mul;
      return;
    }
    rope.Apply(t, src, d, mul, dst);
  }

  // What a query vector's accumulator is multiplied by at the end: 1 / (softmax sum), the sum
  // taken with query head qh's sink logit when there are sinks (gpt-oss: the sink takes
  // probability mass and adds no value), both relative to the larger of the running max m and
  // the sink, so nothing overflows. 0 for a vector that saw nothing and has no sink.
  float Normalizer(int64_t qh, float m, float l) const {
    if (sinks == nullptr) return l > 0.0f ? 1.0f / l : 0.0f;
    const float mx = std::max(m, sinks[qh]);
    const float corr = std::exp(m - mx);
    return corr / (l * corr + std::exp(sinks[qh] - mx));
  }

  // The scales of slots c.. of block blk, head h.
  const float* KScale(int64_t blk, int64_t h, int64_t c) const { return ks + (blk * hkv + h) * block_size + c; }
  const float* VScale(int64_t blk, int64_t h, int64_t c) const { return vs + (blk * hkv + h) * block_size + c; }

  // Element (slot c of block blk, head h, dim e) in this backend's layout.
  template <typename T>
  const T* KAt(int64_t blk, int64_t h, int64_t c, int64_t e) const {
    return static_cast<const T*>(k) + ((blk * hkv + h) * d + e) * block_size + c;
  }
  template <typename T>
  const T* VAt(int64_t blk, int64_t h, int64_t c, int64_t e) const {
    return static_cast<const T*>(v) + ((blk * hkv + h) * block_size + c) * d + e;
  }
};

constexpr int kGroup = 4;  // decode sequences per group item (interleaved memory streams)

struct Item {
  int32_t seq, row0, row1;  // all kv heads of these rows (indices into the sequence's new tokens)
  int64_t cost;
  int32_t group[kGroup] = {-1, -1, -1, -1};  // a decode group: these sequences, one row each
};

// The rows of an item, for one kv head: positions and where their q / out vectors live.
struct Rows {
  int64_t t0, first_pos, last_pos, n;  // n = rows * group query vectors
};

inline Rows RowsOf(const Problem& p, const Item& it) {
  const int64_t q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int64_t first = p.seq_lens[it.seq] - q_len + it.row0, rows = it.row1 - it.row0;
  return {p.query_start_loc[it.seq] + it.row0, first, first + rows - 1, rows * (p.hq / p.hkv)};
}

// Visible slots [lo, hi] of a block starting at `base` for a row at position `pos`.
inline void Visible(const Problem& p, int64_t pos, int64_t base, int64_t width, int64_t* lo, int64_t* hi) {
  *hi = std::min<int64_t>(width - 1, pos - base);
  *lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - base) : 0;
}

using ItemFn = void (*)(const Problem&, const Item&);

// Whether the tiled fast path (and decode grouping) covers this block size and head_dim.
inline bool Tiled(int64_t bs, int64_t d) { return bs % kW == 0 && (d == 64 || d == 128 || d == 256); }

// The item function for pages of element type T, block_size bs and head_dim d (attention_tiles.h;
// instantiated for float and Bf16 by attention_float.cc, for int8_t, E4m3 and E5m2 by attention_quant.cc).
template <typename T>
ItemFn PickItemFn(int64_t bs, int64_t d);

}  // namespace jaxserve::attention
