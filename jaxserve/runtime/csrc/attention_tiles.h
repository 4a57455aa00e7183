// Ragged paged attention's kernels (csrc/paged_attention.cc): the item functions, per page element
// type T, head_dim D and query vectors Q at a time, and their choice per block size and head_dim.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "attention_vec.h"
#include "page_types.h"
#include "vec.h"

namespace jaxserve::attention {

// Any block size / head_dim: plain loops, one query vector at a time.
template <typename T>
void GenericItem(const Problem& p, const Item& it) {
  const int64_t bs = p.block_size, d = p.d, g = p.hq / p.hkv;
  const Rows rw = RowsOf(p, it);
  std::vector<float> acc(d), sc(bs), qv(d);
  const int64_t first_block = p.window > 0 ? std::max<int64_t>(0, rw.first_pos - p.window + 1) / bs : 0;
  for (int64_t i = 0; i < rw.n * p.hkv; ++i) {
    const int64_t h = i / rw.n, r = (i % rw.n) / g, j = i % g, pos = rw.first_pos + r;
    p.LoadQ(rw.t0 + r, h * g + j, 1.0f, qv.data());
    const float* qi = qv.data();
    float m = kNeg, l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = first_block; b * bs <= pos; ++b) {
      const int64_t blk = p.block_tables[it.seq * p.max_blocks + b];
      if (blk < 0 || blk >= p.num_blocks) continue;  // corrupt table: skip rather than read wild
      int64_t lo, hi;
      Visible(p, pos, b * bs, bs, &lo, &hi);
      if (lo > hi) continue;
      float mx = m;
      for (int64_t c = lo; c <= hi; ++c) {
        float s = 0.0f;
        for (int64_t e = 0; e < d; ++e) s += qi[e] * ToFloat(*p.KAt<T>(blk, h, c, e));
        s *= p.scale;
        if constexpr (kQuant<T>) s *= *p.KScale(blk, h, c);
        if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
        sc[c] = s;
        mx = std::max(mx, s);
      }
      const float corr = std::exp(m - mx);
      l *= corr;
      for (int64_t e = 0; e < d; ++e) acc[e] *= corr;
      for (int64_t c = lo; c <= hi; ++c) {
        const float pc = std::exp(sc[c] - mx);
        l += pc;
        const float pv = kQuant<T> ? pc * *p.VScale(blk, h, c) : pc;
        const T* vc = p.VAt<T>(blk, h, c, 0);
        for (int64_t e = 0; e < d; ++e) acc[e] += pv * ToFloat(vc[e]);
      }
      m = mx;
    }
    float* dst = p.out + ((rw.t0 + r) * p.hq + h * g + j) * d;
    const float inv = p.Normalizer(h * g + j, m, l);
    for (int64_t e = 0; e < d; ++e) dst[e] = acc[e] * inv;
  }
}

// The fast path: block_size % 16 == 0 and head_dim D a multiple of 16. Query vectors go Q at a
// time against chunks of kChunkTiles<D> 16-slot tiles, so each K/V vector loaded from the cache
// serves Q of them and the Q accumulations are independent (no FMA latency chains). A vector's
// online-softmax step (its lane reductions, the rescale of its accumulator when the max moves)
// covers a whole chunk: once per 64 slots at head_dim 64, not once per 16 (those steps took about
// half of a prefill item's time).
template <int D>
constexpr int kChunkTiles = D == 64 ? 4 : D == 128 ? 2 : 1;  // the chunk's widened tiles: 32 KiB

// Dot (attribute isa 1, bfloat16 pages): scores and PV sums as bfloat16 dot products on pairs
// (attention_vec.h PairedTile), not float32 FMAs on widened tiles.
template <int D, int Q, typename T, bool Dot = false>
void TiledItem(const Problem& p, const Item& it) {
  constexpr int DV = D / kW, C = kChunkTiles<D>, CW = C * kW;
  using Tile = std::conditional_t<Dot, PairedTile<D>, Widened<D, T>>;
  const int64_t bs = p.block_size, g = p.hq / p.hkv;
  const Rows rw = RowsOf(p, it);
  const int64_t nqh = (rw.n + Q - 1) / Q * Q;  // vectors per kv head, padded to a multiple of Q
  const int64_t nq = nqh * p.hkv;

  // Vector i = h * nqh + r * g + j: kv head h, row r, query head h * g + j.
  // the thread's buffers, kept between items (a heap allocation per item cost ~20% of prefill attention)
  thread_local std::vector<v16> acc;
  thread_local std::vector<float> qs, m, l;
  thread_local std::vector<int64_t> pos;
  thread_local std::vector<Tile> tiles(C);
  thread_local std::vector<uint32_t> qp;  // Dot: the query vectors as bfloat16 pairs
  acc.assign(nq * DV, v16{});
  qs.assign(nq * D, 0.0f), m.assign(nq, kNeg), l.assign(nq, 0.0f);
  pos.assign(nq, -1);  // -1: padding vector
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t i = 0; i < rw.n; ++i) {
      const int64_t r = i / g, j = i % g, dst = h * nqh + i;
      pos[dst] = rw.first_pos + r;
      p.LoadQ(rw.t0 + r, h * g + j, p.scale, qs.data() + dst * D);
    }
  if constexpr (Dot) {
    qp.resize(nq * D / 2);
    RoundBf16Pairs(qs.data(), nq * D, qp.data());
  }
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, rw.first_pos - p.window + 1) : 0;
  const v16 lane = Lanes();

  for (int64_t base = lo / kW * kW; base <= rw.last_pos; base += CW) {
    const int nt = static_cast<int>(std::min<int64_t>(C, (rw.last_pos - base) / kW + 1));
    int64_t blk[C], off[C];
    bool ok[C];  // a corrupt table entry: the tile is skipped rather than read wild
    for (int t = 0; t < nt; ++t) {
      blk[t] = p.block_tables[it.seq * p.max_blocks + (base + t * kW) / bs];
      ok[t] = blk[t] >= 0 && blk[t] < p.num_blocks;
      off[t] = (base + t * kW) % bs;
    }
    for (int64_t h = 0; h < p.hkv; ++h) {
      // bfloat16 pages: each tile is widened (Dot: paired) once here, not once per group of Q query vectors.
      for (int t = 0; t < nt; ++t) {
        if (!ok[t]) continue;
        if constexpr (Dot) {  // V slots past the item's last row are zeroed
          const int valid = static_cast<int>(std::clamp<int64_t>(rw.last_pos - (base + t * kW) + 1, 0, kW));
          tiles[t].Set(p.KAt<T>(blk[t], h, off[t], 0), p.VAt<T>(blk[t], h, off[t], 0), bs, valid);
        } else {
          tiles[t].Set(p.KAt<T>(blk[t], h, off[t], 0), p.VAt<T>(blk[t], h, off[t], 0), bs);
        }
      }
      for (int64_t i0 = h * nqh; i0 < (h + 1) * nqh; i0 += Q) {
        // Visible chunk slots of each vector: [jlo, jhi] (empty when jlo > jhi).
        int64_t jlo[Q], jhi[Q], ulo = CW, uhi = -1;
        for (int q = 0; q < Q; ++q) {
          Visible(p, pos[i0 + q], base, nt * kW, &jlo[q], &jhi[q]);
          if (pos[i0 + q] < 0) jlo[q] = CW;
          if (jlo[q] <= jhi[q]) ulo = std::min(ulo, jlo[q]), uhi = std::max(uhi, jhi[q]);
        }
        if (ulo > uhi) continue;
        const int t0 = static_cast<int>(ulo / kW), t1 = static_cast<int>(uhi / kW);
        const float* qf = qs.data() + i0 * D;
        // Scores, masked to kNeg outside each vector's visible slots, into pr; their lane-wise max.
        alignas(64) float pr[Q][CW];
        v16 vmax[Q];
        for (int q = 0; q < Q; ++q) vmax[q] = v16{} + kNeg;
        for (int t = t0; t <= t1; ++t) {
          v16 sc[Q] = {};
          if (ok[t]) {  // (a tile outside the cache is masked out below)
            if constexpr (Dot) {
              const uint32_t* qv = qp.data() + i0 * D / 2;
              for (int i = 0; i < D / 2; ++i) {
                const u32x16 kv = tiles[t].kp[i];
                for (int q = 0; q < Q; ++q) sc[q] = DotPairs(sc[q], kv, u32x16{} + qv[q * D / 2 + i]);
              }
            } else {
              const float* kf = tiles[t].k;
              const int64_t ks = tiles[t].k_stride;
              for (int e = 0; e < D; ++e) {
                const v16 kv = LoadU(kf + e * ks);
                for (int q = 0; q < Q; ++q) sc[q] += qf[q * D + e] * kv;
              }
              ScaleScores<T>(p, blk[t], h, off[t], sc, Q);
            }
          }
          const v16 slot = lane + static_cast<float>(t * kW);
          for (int q = 0; q < Q; ++q) {
            const v16 x = ok[t] ? MaskScores(p, sc[q], slot, jlo[q], jhi[q]) : v16{} + kNeg;
            std::memcpy(pr[q] + t * kW, &x, sizeof(x));
            vmax[q] = vmax[q] > x ? vmax[q] : x;
          }
        }
        // One online-softmax step per vector over the chunk's tiles t0..t1.
        for (int q = 0; q < Q; ++q) {
          float* pq = pr[q] + t0 * kW;
          if (jlo[q] > jhi[q]) {
            std::memset(pq, 0, (t1 - t0 + 1) * kW * sizeof(float));
            continue;
          }
          OnlineSoftmax<DV>(pq, t1 - t0 + 1, vmax[q], &m[i0 + q], &l[i0 + q], &acc[(i0 + q) * DV]);
          for (int t = t0; t <= t1; ++t) {
            const int64_t a = std::max<int64_t>(jlo[q] - t * kW, 0), b = std::min<int64_t>(jhi[q] - t * kW, kW - 1);
            if (ok[t] && a <= b) ScaleProbs<T>(p, blk[t], h, off[t], a, b, pr[q] + t * kW);
          }
        }
        // Only slots some vector sees are read: past the context a tile may hold anything. (Dot
        // reads pairs of slots: one slot beyond [ulo, uhi] at either end, whose probability is 0 and
        // whose V is the sequence's own or zeroed by PairedTile::Set.)
        v16* av = acc.data() + i0 * DV;
        alignas(64) uint32_t pp[Dot ? Q : 1][CW / 2];  // Dot: the probabilities as bfloat16 pairs
        if constexpr (Dot)
          for (int q = 0; q < Q; ++q)
            for (int t = t0; t <= t1; ++t) RoundBf16Pairs(pr[q] + t * kW, kW, pp[q] + t * kW / 2);
        for (int e = 0; e < DV; ++e) {
          v16 a[Q];
          for (int q = 0; q < Q; ++q) a[q] = av[q * DV + e];
          for (int t = t0; t <= t1; ++t) {
            if (!ok[t]) continue;
            // the tile's slots some vector sees
            const int64_t c0 = std::max<int64_t>(ulo - t * kW, 0), c1 = std::min<int64_t>(uhi - t * kW, kW - 1);
            if constexpr (Dot) {
              for (int64_t c = c0 / 2; c <= c1 / 2; ++c) {
                const u32x16 vv = tiles[t].vp[c * DV + e];
                for (int q = 0; q < Q; ++q) a[q] = DotPairs(a[q], vv, u32x16{} + pp[q][t * kW / 2 + c]);
              }
            } else {
              const float* vf = tiles[t].v;
              for (int64_t c = c0; c <= c1; ++c) {
                const v16 vv = LoadU(vf + c * D + e * kW);
                for (int q = 0; q < Q; ++q) a[q] += pr[q][t * kW + c] * vv;
              }
            }
          }
          for (int q = 0; q < Q; ++q) av[q * DV + e] = a[q];
        }
      }
    }
  }
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t i = 0; i < rw.n; ++i) {
      const int64_t r = i / g, j = i % g, src = h * nqh + i;
      const float inv = p.Normalizer(h * g + j, m[src], l[src]);
      float* dst = p.out + ((rw.t0 + r) * p.hq + h * g + j) * D;
      for (int e = 0; e < DV; ++e) {
        const v16 o = acc[src * DV + e] * inv;
        std::memcpy(dst + e * kW, &o, sizeof(o));
      }
    }
}

// Up to kGroup decode sequences (one row each, group size g <= 4) at once. One sequence at a time
// reads a scattered block as one stream, and a core then waits on memory latency (12 KB random
// runs: ~7 GB/s per core here); interleaving four sequences' loads keeps four streams in flight
// (~16 GB/s). Sequences past their context read a zero tile instead (no branches in the loops).
template <int D, int Q, typename T>
void DecodeGroup(const Problem& p, const Item& it) {
  constexpr int DV = D / kW, S = kGroup;  // Q: query vectors per kv head (>= g = hq / hkv)
  const int64_t bs = p.block_size, g = p.hq / p.hkv, hkv = p.hkv;
  int64_t seq[S], pos[S], t0[S], lo[S];
  int64_t first_tile = INT64_MAX, last_tile = -1;
  for (int s = 0; s < S; ++s) {
    seq[s] = it.group[s];
    pos[s] = seq[s] < 0 ? -1 : p.seq_lens[seq[s]] - 1;
    t0[s] = seq[s] < 0 ? 0 : p.query_start_loc[seq[s]];
    lo[s] = p.window > 0 ? std::max<int64_t>(0, pos[s] - p.window + 1) / kW * kW : 0;
    if (pos[s] >= 0) first_tile = std::min(first_tile, lo[s]), last_tile = std::max(last_tile, pos[s]);
  }
  const v16 lane = Lanes();
  // Per (s, h, q): q vector (scaled), online-softmax state, accumulator.
  const int64_t nv = S * hkv * Q;
  thread_local std::vector<float> qs, m, l;  // the thread's buffers, kept between items
  thread_local std::vector<v16> acc;
  thread_local std::vector<T> zero;
  qs.assign(nv * D, 0.0f), m.assign(nv, kNeg), l.assign(nv, 0.0f);
  acc.assign(nv * DV, v16{});
  zero.assign(D * bs, T{});
  for (int s = 0; s < S; ++s)
    if (pos[s] >= 0)
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t j = 0; j < g; ++j) {
          p.LoadQ(t0[s], h * g + j, p.scale, qs.data() + ((s * hkv + h) * Q + j) * D);
        }

  for (int64_t base = first_tile; base <= last_tile; base += kW) {
    int64_t blk[S], jlo[S], jhi[S], ulo = kW, uhi = -1;
    for (int s = 0; s < S; ++s) {
      blk[s] = -1;
      jlo[s] = kW, jhi[s] = -1;
      if (pos[s] < base || base < lo[s]) continue;
      const int64_t b = p.block_tables[seq[s] * p.max_blocks + base / bs];
      if (b < 0 || b >= p.num_blocks) continue;
      blk[s] = b;
      Visible(p, pos[s], base, kW, &jlo[s], &jhi[s]);
      if (jlo[s] <= jhi[s]) ulo = std::min(ulo, jlo[s]), uhi = std::max(uhi, jhi[s]);
    }
    if (ulo > uhi) continue;
    const int64_t off = base % bs;
    for (int64_t h = 0; h < hkv; ++h) {
      const T* kt[S];
      const T* vt[S];
      for (int s = 0; s < S; ++s) {
        kt[s] = blk[s] < 0 ? zero.data() : p.KAt<T>(blk[s], h, off, 0);
        vt[s] = blk[s] < 0 ? zero.data() : p.VAt<T>(blk[s], h, off, 0);
      }
      v16 sc[S][Q] = {};
      for (int e = 0; e < D; ++e)
        for (int s = 0; s < S; ++s) {
          const v16 kv = LoadU(kt[s] + e * bs);
          const float* qv = qs.data() + (s * hkv + h) * Q * D + e;
          for (int q = 0; q < Q; ++q) sc[s][q] += qv[q * D] * kv;
        }
      for (int s = 0; s < S; ++s)
        if (blk[s] >= 0) ScaleScores<T>(p, blk[s], h, off, sc[s], Q);
      float pr[S][Q][kW];
      for (int s = 0; s < S; ++s)
        for (int q = 0; q < Q; ++q) {
          const int64_t i = (s * hkv + h) * Q + q;
          if (jlo[s] > jhi[s] || q >= g) {
            std::memset(pr[s][q], 0, sizeof(pr[s][q]));
            continue;
          }
          const v16 x = MaskScores(p, sc[s][q], lane, jlo[s], jhi[s]);
          std::memcpy(pr[s][q], &x, sizeof(x));
          OnlineSoftmax<DV>(pr[s][q], 1, x, &m[i], &l[i], &acc[i * DV]);
          ScaleProbs<T>(p, blk[s], h, off, jlo[s], jhi[s], pr[s][q]);
        }
      for (int e = 0; e < DV; ++e) {
        v16 a[S][Q];
        for (int s = 0; s < S; ++s)
          for (int q = 0; q < Q; ++q) a[s][q] = acc[((s * hkv + h) * Q + q) * DV + e];
        for (int64_t c = ulo; c <= uhi; ++c)
          for (int s = 0; s < S; ++s) {
            const v16 vv = LoadU(vt[s] + c * D + e * kW);
            for (int q = 0; q < Q; ++q) a[s][q] += pr[s][q][c] * vv;
          }
        for (int s = 0; s < S; ++s)
          for (int q = 0; q < Q; ++q) acc[((s * hkv + h) * Q + q) * DV + e] = a[s][q];
      }
    }
  }
  for (int s = 0; s < S; ++s)
    if (pos[s] >= 0)
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t i = (s * hkv + h) * Q + j;
          const float inv = p.Normalizer(h * g + j, m[i], l[i]);
          float* dst = p.out + (t0[s] * p.hq + h * g + j) * D;
          for (int e = 0; e < DV; ++e) {
            const v16 o = acc[i * DV + e] * inv;
            std::memcpy(dst + e * kW, &o, sizeof(o));
          }
        }
}

// Decode groups go to DecodeGroup; decode items (a few query vectors per kv head) take Q = 4,
// prefill items Q = 8; bfloat16 pages under attribute isa 1 (where built) take the Dot kernels.
template <int D, typename T>
void TiledAny(const Problem& p, const Item& it) {
  if (it.group[0] >= 0) {
    const int64_t g = p.hq / p.hkv;  // <= 4 (grouping is off otherwise)
    return g == 1 ? DecodeGroup<D, 1, T>(p, it) : g == 2 ? DecodeGroup<D, 2, T>(p, it)
           : g == 3 ? DecodeGroup<D, 3, T>(p, it) : DecodeGroup<D, 4, T>(p, it);
  }
  const bool few = (it.row1 - it.row0) * (p.hq / p.hkv) <= 4;
  if constexpr (std::is_same_v<T, Bf16> && kHaveDotBf16)
    if (p.isa == 1) return few ? TiledItem<D, 4, T, true>(p, it) : TiledItem<D, 8, T, true>(p, it);
  return few ? TiledItem<D, 4, T>(p, it) : TiledItem<D, 8, T>(p, it);
}

// (attention.h) The generic loops, or the fast path where Tiled(bs, d).
template <typename T>
ItemFn PickItemFn(int64_t bs, int64_t d) {
  if (!Tiled(bs, d)) return GenericItem<T>;
  return d == 64 ? TiledAny<64, T> : d == 128 ? TiledAny<128, T> : TiledAny<256, T>;
}

}  // namespace jaxserve::attention
