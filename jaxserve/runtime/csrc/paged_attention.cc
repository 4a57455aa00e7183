// Ragged paged attention for XLA:CPU, as XLA FFI custom calls (the KV write into its pages: csrc/kv_write.cc).
//
// Contract of pallas_kernels.reference.ragged_paged_attention (float32 q and math; float32,
// bfloat16, int8 or fp8 (e4m3fn / e5m2) pages, widened on load; under attribute isa 1 bfloat16
// pages' prefill items round q and the probabilities to bfloat16 and take AVX-512 BF16 dot
// products, float32 accumulation: csrc/attention_vec.h PairedTile): q[T, Hq, D]; sequence
// s owns the new tokens query_start_loc[s] .. query_start_loc[s+1] and has seq_lens[s] tokens of
// context including them; its pages are block_tables[s, :]. Rows past query_start_loc[num_seqs]
// are padding and come out zero. sinks f32[Hq] (gpt-oss), or f32[0] for none: query head h's
// softmax runs over its scores and the logit sinks[h], which takes probability mass and adds no
// value (Problem::Normalizer; the one place it enters, once per query vector). rope_cos / rope_sin
// f32[T, R] (or f32[0] both: none): the layer's RoPE, applied to each query vector as it is loaded
// (csrc/rope.h; the KV write rotates the keys).
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
// float32 accumulation). Items are spread over XLA's intra-op thread pool, each to the core whose
// matmul row share computed its rows (parallel.h ForEachInRowShares), costliest first.
//
// The KV write (csrc/kv_write.cc) copies each new token's K/V into its slot of the pages. The
// problem and work items: csrc/attention.h; the kernels: csrc/attention_tiles.h (vector steps:
// csrc/attention_vec.h), built per page type in attention_float.cc and attention_quant.cc.
//
// Built on first use by jaxserve/runtime/cpu_kernels.py (g++ -O3 -march=native).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "attention.h"
#include "page_types.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxserve::attention {
namespace {

constexpr int kRowsPerItem = 32;  // prefill rows per work item (decode items have one row)

// The item function for the pages' element type (nullptr: not a type this kernel reads).
ItemFn ItemFnFor(ffi::DataType type, int64_t bs, int64_t d) {
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
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> rope_cos,
                     ffi::Buffer<ffi::F32> rope_sin, float sm_scale, int64_t sliding_window, float soft_cap,
                     int64_t isa, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: expected q[T,Hq,D], pages[nb,bs,Hkv,D]");
  const auto type = k.element_type();
  const bool quant = type != ffi::DataType::F32 && type != ffi::DataType::BF16;
  const ItemFn fn = ItemFnFor(type, kd[1], kd[3]);
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
  if (ffi::Error e = BindRope(rope_cos, rope_sin, qd[0], qd[2], "paged attention", &p.rope); e.failure()) return e;
  if (isa != 0 && isa != 1) return ffi::Error::InvalidArgument("paged attention: isa must be 0 or 1");
  if (isa == 1 && !kHaveDotBf16)
    return ffi::Error::InvalidArgument("paged attention: isa 1 asked of a library built without AVX-512 BF16");
  p.isa = isa;
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

  // Each item's rows on the core whose matmul share wrote them (q) and reads them next (o_proj).
  std::vector<int64_t> first_row(items.size());
  for (size_t i = 0; i < items.size(); ++i) first_row[i] = qsl[items[i].seq] + items[i].row0;
  ForEachInRowShares(pool, first_row, valid, [&](int64_t i) { fn(p, items[i]); });
  return ffi::Error::Success();
}

ffi::Error FloatAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> rope_cos, ffi::Buffer<ffi::F32> rope_sin,
                          float sm_scale, int64_t sliding_window, float soft_cap, int64_t isa,
                          ffi::ResultBuffer<ffi::F32> out) {
  return Attention(pool, q, k, v, nullptr, nullptr, seq_lens, query_start_loc, block_tables, num_seqs, sinks,
                   rope_cos, rope_sin, sm_scale, sliding_window, soft_cap, isa, out);
}

ffi::Error QuantAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> rope_cos, ffi::Buffer<ffi::F32> rope_sin,
                          float sm_scale, int64_t sliding_window, float soft_cap, int64_t isa,
                          ffi::ResultBuffer<ffi::F32> out) {
  return Attention(pool, q, k, v, &k_scale, &v_scale, seq_lens, query_start_loc, block_tables, num_seqs, sinks,
                   rope_cos, rope_sin, sm_scale, sliding_window, soft_cap, isa, out);
}

// The attention calls' operands after the pages (and the quantized pages' scales), attributes and
// result.
template <typename B>
auto AttentionRest(B pages) {
  return std::move(pages)
      .template Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
      .template Arg<ffi::Buffer<ffi::S32>>()  // block_tables
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
      .template Arg<ffi::Buffer<ffi::F32>>()  // sinks f32[Hq], or f32[0]: none
      .template Arg<ffi::Buffer<ffi::F32>>()  // RoPE cos f32[T, R] for q (csrc/rope.h), or f32[0]: none
      .template Arg<ffi::Buffer<ffi::F32>>()  // RoPE signed sin f32[T, R], or f32[0]
      .template Attr<float>("sm_scale")
      .template Attr<int64_t>("sliding_window")
      .template Attr<float>("soft_cap")
      .template Attr<int64_t>("isa")  // 1: bfloat16 pages' dot products (cpu_kernels.attention_isa), else 0
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace
}  // namespace jaxserve::attention

using jaxserve::attention::AttentionRest;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, jaxserve::attention::FloatAttention,
                              AttentionRest(jaxserve::BindPoolF32()        // q
                                                .Arg<ffi::AnyBuffer>()     // k_pages (float32 or bfloat16)
                                                .Arg<ffi::AnyBuffer>()));  // v_pages

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionQuant, jaxserve::attention::QuantAttention,
                              AttentionRest(jaxserve::BindPoolF32()                // q
                                                .Arg<ffi::AnyBuffer>()             // k_pages data (int8 / fp8)
                                                .Arg<ffi::AnyBuffer>()             // v_pages data
                                                .Arg<ffi::Buffer<ffi::F32>>()      // k scales [nb, bs, Hkv]
                                                .Arg<ffi::Buffer<ffi::F32>>()));  // v scales
