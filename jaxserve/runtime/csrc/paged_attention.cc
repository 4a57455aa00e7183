// Ragged paged attention for XLA:CPU, as XLA FFI custom calls: the KV write and the attention.
//
// Contract of pallas_kernels.reference.ragged_paged_attention (float32 q and math; float32,
// bfloat16, int8 or fp8 (e4m3fn / e5m2) pages, widened on load): q[T, Hq, D]; sequence
// s owns the new tokens query_start_loc[s] .. query_start_loc[s+1] and has seq_lens[s] tokens of
// context including them; its pages are block_tables[s, :]. Rows past query_start_loc[num_seqs]
// are padding and come out zero. sinks f32[Hq] (gpt-oss), or f32[0] for none: query head h's
// softmax runs over its scores and the logit sinks[h], which takes probability mass and adds no
// value (Problem::Normalizer; the one place it enters, once per query vector).
//
// Page layout. The cache arrays keep the engine's nominal shape [num_blocks, block_size, Hkv, D],
// but this backend owns their contents (it writes them and is the only reader) and lays each
// block out for the CPU:
//   K block: [Hkv][D][block_size]  (transposed: 16 consecutive slots of one dim are one vector)
//   V block: [Hkv][block_size][D]
// so a head's part of a block is one contiguous run, and scoring needs no transposes.
// Quantized pages (pallas_kernels/kv_quant.py) come with float32 scales, one per (slot, kv head),
// held per block as [Hkv][block_size] in the nominal [num_blocks, block_size, Hkv] array. A tile's
// int8/fp8 values are widened exactly; the scales then multiply the tile's scores (K) and its
// probabilities (V), never the K/V elements.
//
// Attention: each work item is (sequence, block of rows, all kv heads); it reads the sequence's
// pages once and scores the rows' query vectors Q at a time against 16-slot tiles (online softmax,
// float32 accumulation). Items are spread over XLA's intra-op thread pool.
//
// The KV write copies each new token's K/V into its slot of the (aliased, so in place) pages;
// XLA:CPU's scatter does the same element by element, far slower.
//
// Built on first use by jaxserve/runtime/cpu_kernels.py (g++ -O3 -march=native).

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -1e30f;  // "no score yet"; finite so fast-math cannot break the logic
constexpr int kRowsPerItem = 32;  // prefill rows per work item (decode items have one row)

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

// bfloat16 storage: the top half of a float32. Reading widens exactly; writing rounds to nearest
// even (as XLA's convert does).
struct Bf16 {
  uint16_t bits;
};
inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline void Store(float x, float* dst) { *dst = x; }
inline void Store(float x, Bf16* dst) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  dst->bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void Store(uint8_t x, uint8_t* dst) { *dst = x; }  // quantized bytes (made by kv_quant.quantize)

// Quantized storage: int8, and fp8 as e4m3fn (4 exponent bits, bias 7, 3 mantissa bits) or e5m2
// (bias 15, 2 mantissa bits). Widening is exact; the NaN codes never occur (values are clipped to
// the format's max before they are stored).
template <int M, int Bias>
struct Fp8 {
  uint8_t bits;
};
using E4m3 = Fp8<3, 7>;
using E5m2 = Fp8<2, 15>;
template <typename T>
constexpr bool kQuant = !std::is_same<T, float>::value && !std::is_same<T, Bf16>::value;

inline float ToFloat(int8_t x) { return static_cast<float>(x); }
// value = mantissa (with its implicit leading one when the exponent field is not zero) * 2^(e - bias - M),
// the power of two made from its bits (always a normal float): no subnormal arithmetic, no table.
template <int M, int Bias>
inline float ToFloat(Fp8<M, Bias> x) {
  const int32_t m = x.bits & ((1 << M) - 1), e = (x.bits >> M) & ((1 << (7 - M)) - 1);
  const uint32_t pow_bits = uint32_t(std::max(e, 1) - Bias - M + 127) << 23;
  float pow;
  std::memcpy(&pow, &pow_bits, sizeof(pow));
  const float v = static_cast<float>(e == 0 ? m : m + (1 << M)) * pow;
  return x.bits & 0x80 ? -v : v;
}

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

Rows RowsOf(const Problem& p, const Item& it) {
  const int64_t q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int64_t first = p.seq_lens[it.seq] - q_len + it.row0, rows = it.row1 - it.row0;
  return {p.query_start_loc[it.seq] + it.row0, first, first + rows - 1, rows * (p.hq / p.hkv)};
}

// Visible slots [lo, hi] of a block starting at `base` for a row at position `pos`.
inline void Visible(const Problem& p, int64_t pos, int64_t base, int64_t width, int64_t* lo, int64_t* hi) {
  *hi = std::min<int64_t>(width - 1, pos - base);
  *lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - base) : 0;
}

// Any block size / head_dim: plain loops, one query vector at a time.
template <typename T>
void GenericItem(const Problem& p, const Item& it) {
  const int64_t bs = p.block_size, d = p.d, g = p.hq / p.hkv;
  const Rows rw = RowsOf(p, it);
  std::vector<float> acc(d), sc(bs);
  const int64_t first_block = p.window > 0 ? std::max<int64_t>(0, rw.first_pos - p.window + 1) / bs : 0;
  for (int64_t i = 0; i < rw.n * p.hkv; ++i) {
    const int64_t h = i / rw.n, r = (i % rw.n) / g, j = i % g, pos = rw.first_pos + r;
    const float* qi = p.q + ((rw.t0 + r) * p.hq + h * g + j) * d;
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
// time against 16-slot tiles, so each K/V vector loaded from the cache serves Q of them and the
// Q accumulations are independent (no FMA latency chains).
using jaxserve::Exp;
using jaxserve::kW;  // slots per tile = floats per v16
using jaxserve::LoadU;
using jaxserve::v16;

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
using i32x16 = int32_t __attribute__((vector_size(64)));
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

// One online-softmax step of a query vector over a 16-slot tile whose visible lanes are
// [jlo, jhi]: scores -> probabilities in pr (zero outside), running max m and sum l updated, the
// accumulator acc[DV] rescaled.
template <int DV>
inline void OnlineSoftmax(const Problem& p, v16 x, int64_t jlo, int64_t jhi, float* m, float* l, v16* acc,
                          float* pr) {
  v16 lane;
  for (int c = 0; c < kW; ++c) lane[c] = static_cast<float>(c);
  if (p.soft_cap > 0.0f)
    for (int c = 0; c < kW; ++c) x[c] = p.soft_cap * std::tanh(x[c] / p.soft_cap);
  const auto vis = (lane >= static_cast<float>(jlo)) & (lane <= static_cast<float>(jhi));
  x = vis ? x : v16{} + kNeg;
  const float mx = std::max(*m, HMax(x));
  v16 ex = Exp(x - mx);
  ex = vis ? ex : v16{};
  std::memcpy(pr, &ex, sizeof(ex));
  const float corr = std::exp(*m - mx);
  *m = mx;
  *l = *l * corr + HSum(ex);
  for (int e = 0; e < DV; ++e) acc[e] *= corr;
}

// A 16-slot tile of one head as float32: float pages are used in place (K rows bs apart),
// bfloat16 pages are widened into the object's buffers (K rows 16 apart).
template <int D, typename T>
struct Widened {
  alignas(64) float kbuf[D * kW];
  alignas(64) float vbuf[kW * D];
  const float* k;
  const float* v;
  int64_t k_stride;
  Widened(const T* kt, const T* vt, int64_t bs) : k(kbuf), v(vbuf), k_stride(kW) {
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
  const float* k;
  const float* v;
  int64_t k_stride;
  Widened(const float* kt, const float* vt, int64_t bs) : k(kt), v(vt), k_stride(bs) {}
};

template <int D, int Q, typename T>
void TiledItem(const Problem& p, const Item& it) {
  constexpr int DV = D / kW;
  const int64_t bs = p.block_size, g = p.hq / p.hkv;
  const Rows rw = RowsOf(p, it);
  const int64_t nqh = (rw.n + Q - 1) / Q * Q;  // vectors per kv head, padded to a multiple of Q
  const int64_t nq = nqh * p.hkv;

  // Vector i = h * nqh + r * g + j: kv head h, row r, query head h * g + j.
  std::vector<v16> acc(nq * DV, v16{});
  std::vector<float> qs(nq * D, 0.0f), m(nq, kNeg), l(nq, 0.0f);
  std::vector<int64_t> pos(nq, -1);  // -1: padding vector
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t i = 0; i < rw.n; ++i) {
      const int64_t r = i / g, j = i % g, dst = h * nqh + i;
      pos[dst] = rw.first_pos + r;
      const float* src = p.q + ((rw.t0 + r) * p.hq + h * g + j) * D;
      for (int e = 0; e < D; ++e) qs[dst * D + e] = src[e] * p.scale;
    }
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, rw.first_pos - p.window + 1) : 0;

  for (int64_t base = lo / kW * kW; base <= rw.last_pos; base += kW) {
    const int64_t blk = p.block_tables[it.seq * p.max_blocks + base / bs];
    if (blk < 0 || blk >= p.num_blocks) continue;
    const int64_t off = base % bs;
    for (int64_t h = 0; h < p.hkv; ++h) {
      const T* kt = p.KAt<T>(blk, h, off, 0);  // kt[e * bs + c]: 16 slots of dim e
      const T* vt = p.VAt<T>(blk, h, off, 0);  // vt[c * D + e]
      // bfloat16 pages: the tile is widened once here, not once per group of Q query vectors.
      const Widened<D, T> tile(kt, vt, bs);
      const float* kf = tile.k;
      const float* vf = tile.v;
      const int64_t ks = tile.k_stride;
      for (int64_t i0 = h * nqh; i0 < (h + 1) * nqh; i0 += Q) {
        // Visible tile lanes of each vector: [jlo, jhi] (empty when jlo > jhi).
        int64_t jlo[Q], jhi[Q], ulo = kW, uhi = -1;
        for (int q = 0; q < Q; ++q) {
          Visible(p, pos[i0 + q], base, kW, &jlo[q], &jhi[q]);
          if (pos[i0 + q] < 0) jlo[q] = kW;
          if (jlo[q] <= jhi[q]) ulo = std::min(ulo, jlo[q]), uhi = std::max(uhi, jhi[q]);
        }
        if (ulo > uhi) continue;
        const float* qf = qs.data() + i0 * D;
        v16 sc[Q] = {};
        for (int e = 0; e < D; ++e) {
          const v16 kv = LoadU(kf + e * ks);
          for (int q = 0; q < Q; ++q) sc[q] += qf[q * D + e] * kv;
        }
        ScaleScores<T>(p, blk, h, off, sc, Q);
        float pr[Q][kW];
        for (int q = 0; q < Q; ++q) {
          const int64_t i = i0 + q;
          if (jlo[q] > jhi[q]) {
            for (int c = 0; c < kW; ++c) pr[q][c] = 0.0f;
            continue;
          }
          OnlineSoftmax<DV>(p, sc[q], jlo[q], jhi[q], &m[i], &l[i], &acc[i * DV], pr[q]);
          ScaleProbs<T>(p, blk, h, off, jlo[q], jhi[q], pr[q]);
        }
        // Only slots some vector sees are read: past the context a tile may hold anything.
        v16* av = acc.data() + i0 * DV;
        for (int e = 0; e < DV; ++e) {
          v16 a[Q];
          for (int q = 0; q < Q; ++q) a[q] = av[q * DV + e];
          for (int64_t c = ulo; c <= uhi; ++c) {
            const v16 vv = LoadU(vf + c * D + e * kW);
            for (int q = 0; q < Q; ++q) a[q] += pr[q][c] * vv;
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

using ItemFn = void (*)(const Problem&, const Item&);

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
  // Per (s, h, q): q vector (scaled), online-softmax state, accumulator.
  const int64_t nv = S * hkv * Q;
  std::vector<float> qs(nv * D, 0.0f), m(nv, kNeg), l(nv, 0.0f);
  std::vector<v16> acc(nv * DV, v16{});
  std::vector<T> zero(D * bs, T{});
  for (int s = 0; s < S; ++s)
    if (pos[s] >= 0)
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t j = 0; j < g; ++j) {
          const float* src = p.q + (t0[s] * p.hq + h * g + j) * D;
          float* dst = qs.data() + ((s * hkv + h) * Q + j) * D;
          for (int e = 0; e < D; ++e) dst[e] = src[e] * p.scale;
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
          OnlineSoftmax<DV>(p, sc[s][q], jlo[s], jhi[s], &m[i], &l[i], &acc[i * DV], pr[s][q]);
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
// prefill items Q = 8.
template <int D, typename T>
void TiledAny(const Problem& p, const Item& it) {
  if (it.group[0] >= 0) {
    const int64_t g = p.hq / p.hkv;  // <= 4 (grouping is off otherwise)
    return g == 1 ? DecodeGroup<D, 1, T>(p, it) : g == 2 ? DecodeGroup<D, 2, T>(p, it)
           : g == 3 ? DecodeGroup<D, 3, T>(p, it) : DecodeGroup<D, 4, T>(p, it);
  }
  if ((it.row1 - it.row0) * (p.hq / p.hkv) <= 4) return TiledItem<D, 4, T>(p, it);
  return TiledItem<D, 8, T>(p, it);
}

// Whether the tiled fast path (and decode grouping) covers this block size and head_dim.
inline bool Tiled(int64_t bs, int64_t d) { return bs % kW == 0 && (d == 64 || d == 128 || d == 256); }

template <typename T>
ItemFn PickItemFn(int64_t bs, int64_t d) {
  if (!Tiled(bs, d)) return GenericItem<T>;
  return d == 64 ? TiledAny<64, T> : d == 128 ? TiledAny<128, T> : TiledAny<256, T>;
}

// The item function for the pages' element type (nullptr: not a type this kernel reads).
ItemFn PickItemFn(ffi::DataType type, int64_t bs, int64_t d) {
  switch (type) {
    case ffi::DataType::F32: return PickItemFn<float>(bs, d);
    case ffi::DataType::BF16: return PickItemFn<Bf16>(bs, d);
    case ffi::DataType::S8: return PickItemFn<int8_t>(bs, d);
    case ffi::DataType::F8E4M3FN: return PickItemFn<E4m3>(bs, d);
    case ffi::DataType::F8E5M2: return PickItemFn<E5m2>(bs, d);
    default: return nullptr;
  }
}

// Float pages (k_scale == nullptr) or quantized pages with their scales.
ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                     ffi::AnyBuffer v, const ffi::Buffer<ffi::F32>* k_scale, const ffi::Buffer<ffi::F32>* v_scale,
                     ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> block_tables,
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks, float sm_scale,
                     int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: expected q[T,Hq,D], pages[nb,bs,Hkv,D]");
  const auto type = k.element_type();
  const bool quant = type != ffi::DataType::F32 && type != ffi::DataType::BF16;
  const ItemFn fn = PickItemFn(type, kd[1], kd[3]);
  if (type != v.element_type() || fn == nullptr || quant != (k_scale != nullptr))
    return ffi::Error::InvalidArgument(
        "paged attention: pages must be float32 or bfloat16, or int8/fp8 with scales, both alike");
  if (quant && (k_scale->element_count() != kd[0] * kd[1] * kd[2] ||
                v_scale->element_count() != kd[0] * kd[1] * kd[2]))
    return ffi::Error::InvalidArgument("paged attention: scales must be [nb, bs, Hkv]");
  const int64_t t = qd[0];
  Problem p;
  std::vector<Item> items;
  p = Problem{q.typed_data(), k.untyped_data(), v.untyped_data(), out->typed_data(),
              seq_lens.typed_data(), query_start_loc.typed_data(), block_tables.typed_data(),
              block_tables.dimensions()[1], kd[0], kd[1], qd[1], kd[2], qd[2],
              sm_scale, soft_cap, sliding_window};
  if (quant) p.ks = k_scale->typed_data(), p.vs = v_scale->typed_data();
  if (sinks.element_count() != 0 && sinks.element_count() != qd[1])
    return ffi::Error::InvalidArgument("paged attention: sinks must be f32[Hq] (or f32[0]: none)");
  if (sinks.element_count() != 0) p.sinks = sinks.typed_data();
  if (p.hq % p.hkv != 0 || kd[3] != p.d)
    return ffi::Error::InvalidArgument("paged attention: head counts or head_dim do not match");
  const int64_t s_cap = seq_lens.dimensions()[0];
  const int64_t ns = std::min<int64_t>(num_seqs.typed_data()[0], s_cap);
  const int32_t* qsl = p.query_start_loc;
  const int64_t valid = ns > 0 ? std::clamp<int64_t>(qsl[ns], 0, t) : 0;
  if (valid < t) std::memset(p.out + valid * p.hq * p.d, 0, (t - valid) * p.hq * p.d * sizeof(float));

  const bool grouped = Tiled(p.block_size, p.d) && p.hq / p.hkv <= 4;
  std::vector<int32_t> decodes;  // single-row sequences, grouped below when the fast path runs
  for (int32_t s = 0; s < ns; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (q_len == 0) continue;
    if (q_len < 0 || qsl[s] < 0 || qsl[s + 1] > t || p.seq_lens[s] < q_len ||
        (p.seq_lens[s] + p.block_size - 1) / p.block_size > p.max_blocks)
      return ffi::Error::InvalidArgument("paged attention: inconsistent batch metadata");
    if (q_len == 1 && grouped) {
      decodes.push_back(s);
      continue;
    }
    for (int32_t r0 = 0; r0 < q_len; r0 += kRowsPerItem) {
      const int32_t r1 = std::min<int64_t>(q_len, r0 + kRowsPerItem);
      const int64_t cost = (r1 - r0) * (p.seq_lens[s] - q_len + r1) + 64;
      items.push_back({s, r0, r1, cost});
    }
  }
  // Similar context lengths share a group, so few tiles run with idle lanes.
  std::sort(decodes.begin(), decodes.end(),
            [&](int32_t a, int32_t b) { return p.seq_lens[a] > p.seq_lens[b]; });
  for (size_t i = 0; i < decodes.size(); i += kGroup) {
    Item item{decodes[i], 0, 1, 0};
    for (size_t j = 0; j < kGroup && i + j < decodes.size(); ++j) {
      item.group[j] = decodes[i + j];
      item.cost += p.seq_lens[decodes[i + j]] + 64;
    }
    items.push_back(item);
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.cost > b.cost; });

  jaxserve::ParallelFor(pool, items.size(), [&](int64_t i) { fn(p, items[i]); });
  return ffi::Error::Success();
}

ffi::Error FloatAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::F32> sinks, float sm_scale, int64_t sliding_window, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out) {
  return Attention(pool, q, k, v, nullptr, nullptr, seq_lens, query_start_loc, block_tables, num_seqs, sinks,
                   sm_scale, sliding_window, soft_cap, out);
}

ffi::Error QuantAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::F32> sinks, float sm_scale, int64_t sliding_window, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out) {
  return Attention(pool, q, k, v, &k_scale, &v_scale, seq_lens, query_start_loc, block_tables, num_seqs, sinks,
                   sm_scale, sliding_window, soft_cap, out);
}

// Tokens t0..t1-1 go to consecutive slots c0.. of block blk: for each (head, dim) the run's K
// values fill consecutive slots (one cache line for a 16-token run), V rows are contiguous.
// S -> T: float -> float / bfloat16, or quantized bytes as they are; scales are rows of d = 1.
template <typename S, typename T>
void WriteRun(const S* k, const S* v, int64_t t0, int64_t t1, int64_t blk, int64_t c0, int64_t bs,
              int64_t hkv, int64_t d, T* ko, T* vo) {
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t e = 0; e < d; ++e) {
      T* kdst = ko + ((blk * hkv + h) * d + e) * bs + c0;  // K block [Hkv][D][bs]
      for (int64_t t = t0; t < t1; ++t) Store(k[(t * hkv + h) * d + e], kdst + (t - t0));
    }
    for (int64_t t = t0; t < t1; ++t) {
      const S* vr = v + (t * hkv + h) * d;
      T* vdst = vo + ((blk * hkv + h) * bs + c0 + (t - t0)) * d;  // V block [Hkv][bs][D]
      for (int64_t e = 0; e < d; ++e) Store(vr[e], vdst + e);
    }
  }
}

// Splits the tokens into runs of consecutive slots within one block and writes the runs in
// parallel. Runs into the same block as the run before (padding tokens all write the null block)
// stay in one work item, so no two threads write one block.
template <typename S, typename T>
void WriteRows(ffi::ThreadPool& pool, const S* k, const S* v, const int32_t* slots, int64_t t_count,
               int64_t bs, int64_t hkv, int64_t d, T* ko, T* vo) {
  std::vector<int64_t> run_start, item_start;  // item i covers runs item_start[i] .. item_start[i+1]-1
  for (int64_t t = 0; t < t_count; ++t) {
    const bool extends = t > 0 && slots[t] == slots[t - 1] + 1 && slots[t] % bs != 0;
    if (extends) continue;
    if (run_start.empty() || slots[t] / bs != slots[run_start.back()] / bs) item_start.push_back(run_start.size());
    run_start.push_back(t);
  }
  run_start.push_back(t_count);
  item_start.push_back(run_start.size() - 1);
  jaxserve::ParallelFor(pool, item_start.size() - 1, [&](int64_t i) {
    for (int64_t r = item_start[i]; r < item_start[i + 1]; ++r) {
      const int64_t t0 = run_start[r], t1 = run_start[r + 1];
      WriteRun(k, v, t0, t1, slots[t0] / bs, slots[t0] % bs, bs, hkv, d, ko, vo);
    }
  });
}

ffi::Error WriteKv(ffi::ThreadPool pool, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slot_mapping,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pd = k_pages.dimensions();
  const auto kd = k.dimensions();
  if (pd.size() != 4 || kd.size() != 3 || kd[1] != pd[2] || kd[2] != pd[3])
    return ffi::Error::InvalidArgument("kv write: expected pages[nb,bs,Hkv,D] and k/v[T,Hkv,D]");
  const auto type = k_pages.element_type();
  if (type != v_pages.element_type() || (type != ffi::DataType::F32 && type != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("kv write: pages must be float32 or bfloat16, both alike");
  const int64_t bs = pd[1], hkv = pd[2], d = pd[3], num_slots = pd[0] * bs;
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < kd[0]; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return ffi::Error::InvalidArgument("kv write: slot out of range");
  // The outputs alias the pages (input_output_aliases): XLA hands us the cache itself.
  if (type == ffi::DataType::BF16)
    WriteRows(pool, k.typed_data(), v.typed_data(), slots, kd[0], bs, hkv, d,
              static_cast<Bf16*>(k_out->untyped_data()), static_cast<Bf16*>(v_out->untyped_data()));
  else
    WriteRows(pool, k.typed_data(), v.typed_data(), slots, kd[0], bs, hkv, d,
              static_cast<float*>(k_out->untyped_data()), static_cast<float*>(v_out->untyped_data()));
  return ffi::Error::Success();
}

// kv_quant.quantize's arithmetic, bit for bit: exact IEEE division and round-half-even (no
// fast-math here: a reciprocal would round differently from XLA's divide).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
template <typename T>
struct QuantOf;
template <>
struct QuantOf<int8_t> {
  static constexpr float kMax = 127.0f;
  static uint8_t Code(float y) { return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y))); }
};
// fp8 with M mantissa bits and exponent bias Bias, round to nearest even; |y| <= the format's max.
template <int M, int Bias>
struct QuantOf<Fp8<M, Bias>> {
  static constexpr float kMax = M == 3 ? 448.0f : 57344.0f;
  static uint8_t Code(float y) {
    const float a = std::fabs(y);
    const int min_e = 1 - Bias;
    int e;
    std::frexp(a, &e);
    e -= 1;  // a in [2^e, 2^(e+1))
    uint32_t code = 0;
    if (a == 0.0f) {
      code = 0;
    } else if (e < min_e) {  // subnormal: a multiple of 2^(min_e - M); 2^M rounds up into the first normal
      code = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, M - min_e)));
    } else {
      float mq = std::nearbyint(std::ldexp(a, M - e) - float(1 << M));
      if (mq == float(1 << M)) e += 1, mq = 0.0f;
      code = (uint32_t(e + Bias) << M) | static_cast<uint32_t>(mq);
    }
    return static_cast<uint8_t>(code | (std::signbit(y) ? 0x80u : 0u));
  }
};

// x[n, d] float rows -> bytes[n, d] and scales[n]: symmetric absmax per row.
template <typename T>
void QuantizeRows(const float* x, int64_t n, int64_t d, uint8_t* q, float* scale) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * d;
    float top = 0.0f;
    for (int64_t e = 0; e < d; ++e) top = std::max(top, std::fabs(row[e]));
    const float s = top * static_cast<float>(1.0 / QuantOf<T>::kMax);  // as kv_quant.quantize
    const float div = s > 0.0f ? s : 1.0f;
    scale[r] = s;
    for (int64_t e = 0; e < d; ++e) {
      const float y = std::min(std::max(row[e] / div, -QuantOf<T>::kMax), QuantOf<T>::kMax);
      q[r * d + e] = QuantOf<T>::Code(y);
    }
  }
}
#pragma GCC pop_options

// Quantized pages: this step's float K/V rows are quantized here (a scale per token and head) and
// go to their slots, the bytes as they are and the scales as rows of one value.
ffi::Error WriteKvQuant(ffi::ThreadPool pool, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                        ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                        ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::Buffer<ffi::F32>> ks_out,
                        ffi::Result<ffi::Buffer<ffi::F32>> vs_out) {
  const auto pd = k_pages.dimensions();
  const auto kd = k.dimensions();
  if (pd.size() != 4 || kd.size() != 3 || kd[1] != pd[2] || kd[2] != pd[3])
    return ffi::Error::InvalidArgument("kv write: expected pages[nb,bs,Hkv,D] and k/v[T,Hkv,D]");
  const auto type = k_pages.element_type();
  if (type != v_pages.element_type() ||
      (type != ffi::DataType::S8 && type != ffi::DataType::F8E4M3FN && type != ffi::DataType::F8E5M2))
    return ffi::Error::InvalidArgument("kv write: quantized pages must be int8 or fp8, both alike");
  const int64_t bs = pd[1], hkv = pd[2], d = pd[3], num_slots = pd[0] * bs;
  if (k_scales.element_count() != num_slots * hkv)
    return ffi::Error::InvalidArgument("kv write: scales must be [nb, bs, Hkv]");
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < kd[0]; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return ffi::Error::InvalidArgument("kv write: slot out of range");
  const int64_t rows = kd[0] * hkv;
  std::vector<uint8_t> kb(rows * d), vb(rows * d);
  std::vector<float> ks(rows), vs(rows);
  const auto quantize = type == ffi::DataType::S8 ? QuantizeRows<int8_t>
                        : type == ffi::DataType::F8E4M3FN ? QuantizeRows<E4m3> : QuantizeRows<E5m2>;
  quantize(k.typed_data(), rows, d, kb.data(), ks.data());
  quantize(v.typed_data(), rows, d, vb.data(), vs.data());
  WriteRows(pool, kb.data(), vb.data(), slots, kd[0], bs, hkv, d, static_cast<uint8_t*>(k_out->untyped_data()),
            static_cast<uint8_t*>(v_out->untyped_data()));
  WriteRows(pool, ks.data(), vs.data(), slots, kd[0], bs, hkv, int64_t{1}, ks_out->typed_data(),
            vs_out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, FloatAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages (float32 or bfloat16)
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks f32[Hq], or f32[0]: none
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // k_pages (float32 or bfloat16)
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>()  // k_pages (aliased)
                                  .Ret<ffi::AnyBuffer>());  // v_pages (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionQuant, QuantAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages data (int8 / fp8)
                                  .Arg<ffi::AnyBuffer>()  // v_pages data
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [nb, bs, Hkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks f32[Hq], or f32[0]: none
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKvQuant, WriteKvQuant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // k_pages data (int8 / fp8)
                                  .Arg<ffi::AnyBuffer>()  // v_pages data
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [nb, bs, Hkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>()  // k_pages data (aliased)
                                  .Ret<ffi::AnyBuffer>()  // v_pages data (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k scales (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v scales (aliased)
