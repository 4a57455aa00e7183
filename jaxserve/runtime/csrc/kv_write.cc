// The KV write for XLA:CPU's ragged paged attention (csrc/paged_attention.cc: the page layout), as
// XLA FFI custom calls: each new token's K/V copied into its slot of the (aliased, so in place)
// pages; XLA:CPU's scatter does the same element by element, far slower. Quantized pages: the
// rows quantized here first (kv_quant.quantize's arithmetic), a scale per token and head. Given
// the layer's RoPE tables, the key rows are rotated first (csrc/rope.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "page_types.h"
#include "parallel.h"
#include "rope.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxserve::attention {
namespace {

// Tokens t0..t1-1 (rows k[0..], v[0..] here) go to consecutive slots c0.. of block blk: for each
// (head, dim) the run's K values fill consecutive slots (one cache line for a 16-token run), V rows
// are contiguous. S -> T: float -> float / bfloat16, or quantized bytes as they are; scales are
// rows of d = 1.
template <typename S, typename T>
void WriteRun(const S* k, const S* v, int64_t n, int64_t blk, int64_t c0, int64_t bs, int64_t hkv, int64_t d,
              T* ko, T* vo) {
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t e = 0; e < d; ++e) {
      T* kdst = ko + ((blk * hkv + h) * d + e) * bs + c0;  // K block [Hkv][D][bs]
      for (int64_t t = 0; t < n; ++t) Store(k[(t * hkv + h) * d + e], kdst + t);
    }
    for (int64_t t = 0; t < n; ++t) {
      const S* vr = v + (t * hkv + h) * d;
      T* vdst = vo + ((blk * hkv + h) * bs + c0 + t) * d;  // V block [Hkv][bs][D]
      for (int64_t e = 0; e < d; ++e) Store(vr[e], vdst + e);
    }
  }
}

// Splits the tokens into runs of consecutive slots within one block and writes the runs in
// parallel, each on the core whose matmul share computed its rows (ForEachInRowShares). Runs into
// the same block as the run before (padding tokens all write the null block) stay in one work item, so no
// two threads write one block. rope (float rows only): the K rows rotated as they are written.
template <typename S, typename T>
void WriteRows(ffi::ThreadPool& pool, const S* k, const S* v, const int32_t* slots, int64_t t_count,
               int64_t bs, int64_t hkv, int64_t d, T* ko, T* vo, const Rope& rope = Rope{}) {
  std::vector<int64_t> run_start, item_start;  // item i covers runs item_start[i] .. item_start[i+1]-1
  for (int64_t t = 0; t < t_count; ++t) {
    const bool extends = t > 0 && slots[t] == slots[t - 1] + 1 && slots[t] % bs != 0;
    if (extends) continue;
    if (run_start.empty() || slots[t] / bs != slots[run_start.back()] / bs) item_start.push_back(run_start.size());
    run_start.push_back(t);
  }
  run_start.push_back(t_count);
  item_start.push_back(run_start.size() - 1);
  const int64_t items = item_start.size() - 1, row = hkv * d;
  std::vector<int64_t> first_row(items);
  for (int64_t i = 0; i < items; ++i) first_row[i] = run_start[item_start[i]];
  ForEachInRowShares(pool, first_row, t_count, [&](int64_t i) {
    for (int64_t r = item_start[i]; r < item_start[i + 1]; ++r) {
      const int64_t t0 = run_start[r], n = run_start[r + 1] - t0;
      const S* kr = k + t0 * row;
      if constexpr (std::is_same_v<S, float>) {
        thread_local std::vector<float> rotated;
        if (rope.rot) {
          rotated.resize(n * row);
          for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < hkv; ++h) rope.Apply(t0 + t, kr + t * row + h * d, d, 1.0f, &rotated[t * row + h * d]);
          kr = rotated.data();
        }
      }
      WriteRun(kr, v + t0 * row, n, slots[t0] / bs, slots[t0] % bs, bs, hkv, d, ko, vo);
    }
  });
}

ffi::Error WriteKv(ffi::ThreadPool pool, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::F32> rope_cos,
                   ffi::Buffer<ffi::F32> rope_sin, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
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
  Rope rope;
  if (ffi::Error e = BindRope(rope_cos, rope_sin, kd[0], d, "kv write", &rope); e.failure()) return e;
  // The outputs alias the pages (input_output_aliases): XLA hands us the cache itself.
  if (type == ffi::DataType::BF16)
    WriteRows(pool, k.typed_data(), v.typed_data(), slots, kd[0], bs, hkv, d,
              static_cast<Bf16*>(k_out->untyped_data()), static_cast<Bf16*>(v_out->untyped_data()), rope);
  else
    WriteRows(pool, k.typed_data(), v.typed_data(), slots, kd[0], bs, hkv, d,
              static_cast<float*>(k_out->untyped_data()), static_cast<float*>(v_out->untyped_data()), rope);
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
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::F32> rope_cos,
                        ffi::Buffer<ffi::F32> rope_sin, ffi::Result<ffi::AnyBuffer> k_out,
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
  Rope rope;
  if (ffi::Error e = BindRope(rope_cos, rope_sin, kd[0], d, "kv write", &rope); e.failure()) return e;
  const int64_t rows = kd[0] * hkv;
  const float* kf = k.typed_data();
  std::vector<float> rotated;
  if (rope.rot) {  // the K rows rotated before they are quantized
    rotated.resize(rows * d);
    for (int64_t r = 0; r < rows; ++r) rope.Apply(r / hkv, kf + r * d, d, 1.0f, &rotated[r * d]);
    kf = rotated.data();
  }
  std::vector<uint8_t> kb(rows * d), vb(rows * d);
  std::vector<float> ks(rows), vs(rows);
  const auto quantize = type == ffi::DataType::S8 ? QuantizeRows<int8_t>
                        : type == ffi::DataType::F8E4M3FN ? QuantizeRows<E4m3> : QuantizeRows<E5m2>;
  quantize(kf, rows, d, kb.data(), ks.data());
  quantize(v.typed_data(), rows, d, vb.data(), vs.data());
  WriteRows(pool, kb.data(), vb.data(), slots, kd[0], bs, hkv, d, static_cast<uint8_t*>(k_out->untyped_data()),
            static_cast<uint8_t*>(v_out->untyped_data()));
  WriteRows(pool, ks.data(), vs.data(), slots, kd[0], bs, hkv, int64_t{1}, ks_out->typed_data(),
            vs_out->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve::attention

using jaxserve::attention::WriteKv;
using jaxserve::attention::WriteKvQuant;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // k_pages (float32 or bfloat16)
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v[T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Arg<ffi::Buffer<ffi::F32>>()  // RoPE cos f32[T, R] for k (csrc/rope.h), or f32[0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // RoPE signed sin f32[T, R], or f32[0]
                                  .Ret<ffi::AnyBuffer>()  // k_pages (aliased)
                                  .Ret<ffi::AnyBuffer>());  // v_pages (aliased)

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
                                  .Arg<ffi::Buffer<ffi::F32>>()  // RoPE cos f32[T, R] for k, or f32[0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // RoPE signed sin f32[T, R], or f32[0]
                                  .Ret<ffi::AnyBuffer>()  // k_pages data (aliased)
                                  .Ret<ffi::AnyBuffer>()  // v_pages data (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k scales (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v scales (aliased)
