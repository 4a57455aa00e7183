// Ragged paged attention for XLA:CPU, as XLA FFI custom calls: the KV write and the attention.
//
// Same contract as pallas_kernels.reference.ragged_paged_attention (float32 only):
//   q[T, Hq, D] against one layer's pages k/v[num_blocks, block_size, Hkv, D]; sequence s owns
//   the new tokens query_start_loc[s] .. query_start_loc[s+1] and has seq_lens[s] tokens of
//   context including them; its pages are block_tables[s, :]. Rows past query_start_loc[num_seqs]
//   are padding and come out zero.
//
// Why a native kernel: XLA:CPU runs the page gather + tiny batched dots of decode attention at a
// fraction of memory bandwidth. Here each (sequence, kv head, block of rows) reads its pages once,
// straight from the cache, and scores all the rows' query heads of that kv group against them
// (online softmax, float32 accumulation). Work items are spread over XLA's intra-op thread pool.
//
// The KV write copies each new token's K/V row into its slot of the (aliased, so in place)
// pages: XLA:CPU's scatter does the same ~30x slower, element by element.
//
// Built on first use by jaxserve/runtime/cpu_attention.py (g++ -O3 -march=native).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -1e30f;  // "no score yet"; finite so fast-math cannot break the logic
constexpr int kRowsPerItem = 32;  // prefill rows per work item (decode items have one row)

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* block_tables;
  int64_t max_blocks, num_blocks, block_size, hq, hkv, d;
  float scale, soft_cap;
  int64_t window;  // 0: none
};

struct Item {
  int32_t seq, row0, row1;  // all kv heads of these rows (indices into the sequence's new tokens)
  int64_t cost;
};

// One kv head of an item, any block size / head_dim: plain loops.
void GenericHead(const Problem& p, const Item& it, int64_t head) {
  const int64_t bs = p.block_size;
  const int64_t d = p.d;
  const int64_t g = p.hq / p.hkv;
  const int64_t q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int64_t seq_len = p.seq_lens[it.seq];
  const int64_t rows = it.row1 - it.row0;
  const int64_t n = rows * g;  // query vectors in this item
  const int64_t row_stride = p.hkv * d;  // floats between consecutive slots of a page

  std::vector<float> qs(n * d), acc(n * d, 0.0f), m(n, kNeg), l(n, 0.0f);
  std::vector<float> kt(d * bs), sc(bs);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = p.query_start_loc[it.seq] + it.row0 + r;
    for (int64_t j = 0; j < g; ++j) {
      const float* src = p.q + (t * p.hq + head * g + j) * d;
      float* dst = qs.data() + (r * g + j) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = src[e] * p.scale;
    }
  }
  const int64_t first_pos = seq_len - q_len + it.row0;
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const bool transpose = n >= 8;  // many query vectors: score against a transposed page tile

  for (int64_t page = lo / bs; page * bs <= last_pos; ++page) {
    const int64_t blk = p.block_tables[it.seq * p.max_blocks + page];
    if (blk < 0 || blk >= p.num_blocks) continue;  // corrupt table: skip rather than read wild
    const float* kp = p.k + (blk * bs * p.hkv + head) * d;
    const float* vp = p.v + (blk * bs * p.hkv + head) * d;
    const int64_t start = page * bs;
    if (transpose) {
      for (int64_t j = 0; j < bs; ++j)
        for (int64_t e = 0; e < d; ++e) kt[e * bs + j] = kp[j * row_stride + e];
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t ps = first_pos + r;
      // Visible slots of this page for this row: [jlo, jhi].
      const int64_t jhi = std::min<int64_t>(bs - 1, ps - start);
      const int64_t jlo = p.window > 0 ? std::max<int64_t>(0, ps - p.window + 1 - start) : 0;
      if (jhi < 0 || jlo > jhi) continue;
      for (int64_t j = 0; j < g; ++j) {
        const int64_t i = r * g + j;
        const float* qi = qs.data() + i * d;
        if (transpose) {
          for (int64_t c = 0; c < bs; ++c) sc[c] = 0.0f;
          for (int64_t e = 0; e < d; ++e) {
            const float qe = qi[e];
            const float* ke = kt.data() + e * bs;
            for (int64_t c = 0; c < bs; ++c) sc[c] += qe * ke[c];
          }
        } else {
          for (int64_t c = jlo; c <= jhi; ++c) {
            const float* kc = kp + c * row_stride;
            float s = 0.0f;
            for (int64_t e = 0; e < d; ++e) s += qi[e] * kc[e];
            sc[c] = s;
          }
        }
        float mx = m[i];
        for (int64_t c = jlo; c <= jhi; ++c) {
          if (p.soft_cap > 0.0f) sc[c] = p.soft_cap * std::tanh(sc[c] / p.soft_cap);
          mx = std::max(mx, sc[c]);
        }
        const float corr = std::exp(m[i] - mx);
        float sum = 0.0f;
        for (int64_t c = jlo; c <= jhi; ++c) {
          sc[c] = std::exp(sc[c] - mx);
          sum += sc[c];
        }
        m[i] = mx;
        l[i] = l[i] * corr + sum;
        float* ai = acc.data() + i * d;
        for (int64_t e = 0; e < d; ++e) ai[e] *= corr;
        for (int64_t c = jlo; c <= jhi; ++c) {
          const float pc = sc[c];
          const float* vc = vp + c * row_stride;
          for (int64_t e = 0; e < d; ++e) ai[e] += pc * vc[e];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = p.query_start_loc[it.seq] + it.row0 + r;
    for (int64_t j = 0; j < g; ++j) {
      const int64_t i = r * g + j;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      float* dst = p.out + (t * p.hq + head * g + j) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = acc[i * d + e] * inv;
    }
  }
}


void GenericItem(const Problem& p, const Item& it) {
  for (int64_t head = 0; head < p.hkv; ++head) GenericHead(p, it, head);
}

// The fast path: pages taken as tiles of 16 slots (block_size % 16 == 0), head_dim D % 16 == 0.
// Query vectors go 4 at a time, so each K/V row loaded from the cache serves 4 of them and the
// four accumulations are independent (no FMA latency chains).
using v16 = float __attribute__((vector_size(64), aligned(64)));
constexpr int kW = 16;  // slots per tile = floats per v16
constexpr int kQ = 4;   // query vectors per pass

inline float HSum(v16 x) {
  float s = 0.0f;
  for (int c = 0; c < kW; ++c) s += x[c];
  return s;
}

inline v16 LoadU(const float* src) {
  v16 x;
  std::memcpy(&x, src, sizeof(x));
  return x;
}

template <int D>
void TiledItem(const Problem& p, const Item& it) {
  constexpr int DV = D / kW;
  const int64_t bs = p.block_size, g = p.hq / p.hkv, stride = p.hkv * D;
  const int64_t q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int64_t rows = it.row1 - it.row0, per_head = rows * g;
  const int64_t nqh = (per_head + kQ - 1) / kQ * kQ;  // vectors per kv head, padded to kQ
  const int64_t nq = nqh * p.hkv;
  const int64_t first_pos = p.seq_lens[it.seq] - q_len + it.row0, last_pos = first_pos + rows - 1;
  const int64_t t0 = p.query_start_loc[it.seq] + it.row0;

  // Vector i = h * nqh + r * g + j: kv head h, row r, query head h * g + j.
  std::vector<v16> qs(nq * DV, v16{}), acc(nq * DV, v16{}), kt(D);
  std::vector<float> m(nq, kNeg), l(nq, 0.0f);
  std::vector<int64_t> pos(nq, -1);  // -1: padding vector
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < g; ++j) {
        const int64_t i = h * nqh + r * g + j;
        pos[i] = first_pos + r;
        const float* src = p.q + ((t0 + r) * p.hq + h * g + j) * D;
        for (int e = 0; e < DV; ++e) qs[i * DV + e] = LoadU(src + e * kW) * p.scale;
      }
  const bool transpose = per_head > kQ;  // enough query vectors to pay for transposing K tiles
  v16 lane;
  for (int c = 0; c < kW; ++c) lane[c] = static_cast<float>(c);
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;

  for (int64_t base = lo / kW * kW; base <= last_pos; base += kW) {
    const int64_t blk = p.block_tables[it.seq * p.max_blocks + base / bs];
    if (blk < 0 || blk >= p.num_blocks) continue;
    const int64_t slot = blk * bs + base % bs;
    for (int64_t h = 0; h < p.hkv; ++h) {
      const float* kp = p.k + slot * stride + h * D;
      const float* vp = p.v + slot * stride + h * D;
      if (transpose) {
        float* ktf = reinterpret_cast<float*>(kt.data());
        for (int c = 0; c < kW; ++c)
          for (int e = 0; e < D; ++e) ktf[e * kW + c] = kp[c * stride + e];
      }
      for (int64_t i0 = h * nqh; i0 < (h + 1) * nqh; i0 += kQ) {
        // Visible tile lanes of each vector: [jlo, jhi] (empty when jlo > jhi).
        int64_t jlo[kQ], jhi[kQ], ulo = kW, uhi = -1;
        for (int q = 0; q < kQ; ++q) {
          const int64_t ps = pos[i0 + q];
          jhi[q] = std::min<int64_t>(kW - 1, ps - base);
          jlo[q] = p.window > 0 ? std::max<int64_t>(0, ps - p.window + 1 - base) : 0;
          if (ps < 0) jlo[q] = kW;
          if (jlo[q] <= jhi[q]) ulo = std::min(ulo, jlo[q]), uhi = std::max(uhi, jhi[q]);
        }
        if (ulo > uhi) continue;
        const v16* qv = qs.data() + i0 * DV;
        v16 sc[kQ] = {};
        if (transpose) {
          const float* qf = reinterpret_cast<const float*>(qv);
          for (int e = 0; e < D; ++e) {
            const v16 k = kt[e];
            for (int q = 0; q < kQ; ++q) sc[q] += qf[q * D + e] * k;
          }
        } else {
          for (int64_t c = ulo; c <= uhi; ++c) {
            v16 part[kQ] = {};
            for (int e = 0; e < DV; ++e) {
              const v16 k = LoadU(kp + c * stride + e * kW);
              for (int q = 0; q < kQ; ++q) part[q] += qv[q * DV + e] * k;
            }
            for (int q = 0; q < kQ; ++q) sc[q][c] = HSum(part[q]);
          }
        }
        float pr[kQ][kW];
        for (int q = 0; q < kQ; ++q) {
          const int64_t i = i0 + q;
          if (jlo[q] > jhi[q]) {
            for (int c = 0; c < kW; ++c) pr[q][c] = 0.0f;
            continue;
          }
          v16 s = sc[q];
          if (p.soft_cap > 0.0f)
            for (int c = 0; c < kW; ++c) s[c] = p.soft_cap * std::tanh(s[c] / p.soft_cap);
          const auto vis = (lane >= static_cast<float>(jlo[q])) & (lane <= static_cast<float>(jhi[q]));
          s = vis ? s : v16{} + kNeg;
          float mx = m[i];
          for (int c = 0; c < kW; ++c) mx = std::max(mx, s[c]);
          float e[kW], sum = 0.0f;
          for (int c = 0; c < kW; ++c) e[c] = std::exp(s[c] - mx);
          for (int c = 0; c < kW; ++c) pr[q][c] = vis[c] ? e[c] : 0.0f, sum += pr[q][c];
          const float corr = std::exp(m[i] - mx);
          m[i] = mx;
          l[i] = l[i] * corr + sum;
          for (int d = 0; d < DV; ++d) acc[i * DV + d] *= corr;
        }
        v16* av = acc.data() + i0 * DV;
        for (int64_t c = ulo; c <= uhi; ++c) {
          for (int d = 0; d < DV; ++d) {
            const v16 v = LoadU(vp + c * stride + d * kW);
            for (int q = 0; q < kQ; ++q) av[q * DV + d] += pr[q][c] * v;
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < g; ++j) {
        const int64_t i = h * nqh + r * g + j;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        float* dst = p.out + ((t0 + r) * p.hq + h * g + j) * D;
        for (int d = 0; d < DV; ++d) {
          const v16 o = acc[i * DV + d] * inv;
          std::memcpy(dst + d * kW, &o, sizeof(o));
        }
      }
}

using ItemFn = void (*)(const Problem&, const Item&);

ItemFn PickItemFn(int64_t bs, int64_t d) {
  if (bs % kW == 0 && d == 64) return TiledItem<64>;
  if (bs % kW == 0 && d == 128) return TiledItem<128>;
  if (bs % kW == 0 && d == 256) return TiledItem<256>;
  return GenericItem;
}

// Shared by the caller and the pool tasks; owned jointly so a late-starting task is safe.
struct Work {
  Problem p;
  ItemFn fn;
  std::vector<Item> items;
  std::atomic<int64_t> next{0}, done{0};

  void Drain() {
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      fn(p, items[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> block_tables,
                     ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t sliding_window,
                     float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: expected q[T,Hq,D], pages[nb,bs,Hkv,D]");
  const int64_t t = qd[0];
  auto work = std::make_shared<Work>();
  Problem& p = work->p;
  p = Problem{q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
              seq_lens.typed_data(), query_start_loc.typed_data(), block_tables.typed_data(),
              block_tables.dimensions()[1], kd[0], kd[1], qd[1], kd[2], qd[2],
              sm_scale, soft_cap, sliding_window};
  if (p.hq % p.hkv != 0 || kd[3] != p.d)
    return ffi::Error::InvalidArgument("paged attention: head counts or head_dim do not match");
  const int64_t s_cap = seq_lens.dimensions()[0];
  const int64_t ns = std::min<int64_t>(num_seqs.typed_data()[0], s_cap);
  const int32_t* qsl = p.query_start_loc;
  const int64_t valid = ns > 0 ? std::clamp<int64_t>(qsl[ns], 0, t) : 0;
  if (valid < t) std::memset(p.out + valid * p.hq * p.d, 0, (t - valid) * p.hq * p.d * sizeof(float));

  for (int32_t s = 0; s < ns; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (q_len == 0) continue;
    if (q_len < 0 || qsl[s] < 0 || qsl[s + 1] > t || p.seq_lens[s] < q_len ||
        (p.seq_lens[s] + p.block_size - 1) / p.block_size > p.max_blocks)
      return ffi::Error::InvalidArgument("paged attention: inconsistent batch metadata");
    for (int32_t r0 = 0; r0 < q_len; r0 += kRowsPerItem) {
      const int32_t r1 = std::min<int64_t>(q_len, r0 + kRowsPerItem);
      const int64_t cost = (r1 - r0) * (p.seq_lens[s] - q_len + r1) + 64;
      work->items.push_back({s, r0, r1, cost});
    }
  }
  std::sort(work->items.begin(), work->items.end(),
            [](const Item& a, const Item& b) { return a.cost > b.cost; });
  work->fn = PickItemFn(p.block_size, p.d);

  const int64_t total = work->items.size();
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error WriteKv(ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                   ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slot_mapping,
                   ffi::ResultBuffer<ffi::F32> k_out, ffi::ResultBuffer<ffi::F32> v_out) {
  const auto pd = k_pages.dimensions();
  const auto kd = k.dimensions();
  if (pd.size() != 4 || kd.size() != 3 || kd[1] != pd[2] || kd[2] != pd[3])
    return ffi::Error::InvalidArgument("kv write: expected pages[nb,bs,Hkv,D] and k/v[T,Hkv,D]");
  const int64_t row = pd[2] * pd[3], num_slots = pd[0] * pd[1];
  // The outputs alias the pages (input_output_aliases): XLA hands us the cache itself.
  float* ko = k_out->typed_data();
  float* vo = v_out->typed_data();
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < kd[0]; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) return ffi::Error::InvalidArgument("kv write: slot out of range");
    std::memcpy(ko + slot * row, k.typed_data() + t * row, row * sizeof(float));
    std::memcpy(vo + slot * row, v.typed_data() + t * row, row * sizeof(float));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_pages (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v_pages (aliased)
