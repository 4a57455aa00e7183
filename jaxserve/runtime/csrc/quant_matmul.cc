// The linear layers over quantized weights (runtime/quant.py), as XLA FFI custom calls:
//
//   jaxserve_quant_matmul:       y[M, N] = x[M, K] @ W
//   jaxserve_quant_matmul_gated: y[M, N] = silu(x @ W_gate) * (x @ W_up)
//   jaxserve_quant_matmul_grouped: the same over row groups, each times its own weight: a mixture-of-
//       experts layer's experts, stacked [E, ...] (each operand with a leading axis of E), rows sorted
//       by expert, sizes i32[E] rows per expert (runtime/expert_matmul.py); rows past the groups' are 0;
//       with an order i32[M], the kernel's tiles read x's rows in sorted order in place (format_matmul.h)
//
// W is held in the 64-column panels of csrc/matmul.cc, quantized (attribute `format`: an id of
// formats.h, generated from runtime/weight_formats.py's records):
//   kINT8:   q i8[N / 64, K, 64], scale f32[N]               W = q * scale  (scale after the sum)
//   kQ8_0:   q i8[N / 64, K, 64], d f16[N / 64, K / 32, 64]  W = q * d
//   kQ4_1:   q u8[N / 64, K / 2, 64] (k = 2j low nibble, 2j + 1 high), d and m f16 like Q8_0's d,
//            W = q * d + m
//   kFP8:    q u8[N / 64, K, 64] float8_e4m3fn bits, scale f32[N]  W = q * scale (scale after the sum)
//   kQ4_K:   q as Q4's; d f16[N / 64, K / 256, 2, 64] (d, dmin per super-block), m u8[N / 64,
//            K / 32, 2, 64] (6-bit sc, min per 32-block)  W = q * (d * sc) - dmin * min
//   kQ6_K:   q u8[N / 64, K / 256, 192, 64] (per super-block: 128 rows of low-nibble pairs as Q4's,
//            64 rows of the high 2 bits, k = 4j + t in bits 2t), d f16[N / 64, K / 256, 64],
//            m i8[N / 64, K / 16, 64] (sc per 16-block)  W = (q - 32) * (d * sc)
//            (runtime/kquants.py: each product there is exact in float32, so the decode is too)
//   kMXFP4:  q u8[N / 64, K / 2, 64] e2m1 codes laid out as Q4's, d u8[N / 64, K / 32, 64] E8M0
//            exponents  W = e2m1(q) * 2^(d - 127)  (gpt-oss's experts: runtime/mxfp4.py; exact in float32)
// The kernel (csrc/quant_kernel.h; its decoding: csrc/quant_decode.h) decodes each weight in
// registers right before its FMA and sums in the float32 kernel's order; the calls' entry points
// are format_matmul.h's.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "format_matmul.h"
#include "formats.h"
#include "operand_shape.h"
#include "parallel.h"
#include "quant_kernel.h"
#include "x_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve::quant_matmul {
namespace {

bool Dims(const Shape& a, ffi::DataType t, std::initializer_list<int64_t> want) {
  return a.type == t && std::equal(a.dims.begin(), a.dims.end(), want.begin(), want.end());
}

// Q4_K / Q6_K operands (q, d, m = the integer scales) as the format's comment above lays them out.
bool KQuantShapes(Format f, int64_t panels, int64_t k_len, const Shape& q, const Shape& d, const Shape& m) {
  const int64_t sup = k_len / kSuper;
  if (f == kQ4_K)
    return Dims(q, ffi::U8, {panels, k_len / 2, kPanel}) && Dims(d, ffi::F16, {panels, sup, 2, kPanel}) &&
           Dims(m, ffi::U8, {panels, k_len / kBlock, 2, kPanel});
  return Dims(q, ffi::U8, {panels, sup, 192, kPanel}) && Dims(d, ffi::F16, {panels, sup, kPanel}) &&
         Dims(m, ffi::S8, {panels, k_len / 16, kPanel});
}

// The weight's panel count if (q, d, m) is a well-formed weight of format f for x[., K], else -1.
int64_t Check(Format f, int64_t k_len, const Shape& q, const Shape& d, const Shape& m) {
  const auto& qd = q.dims;
  if (qd.size() < 3 || qd.back() != kPanel || (qd.size() != 3 && f != kQ6_K)) return -1;
  const int64_t panels = qd[0], blocks = k_len / kBlock;
  const auto& dd = d.dims;
  const bool block_scales = dd.size() == 3 && dd[0] == panels && dd[1] == blocks && dd[2] == kPanel &&
                            d.type == ffi::F16 && k_len % kBlock == 0;
  switch (f) {
    case kINT8:
    case kFP8:
      return q.type == (f == kINT8 ? ffi::S8 : ffi::U8) && qd[1] == k_len && dd.size() == 1 && dd[0] == panels * kPanel &&
                     d.type == ffi::F32 ? panels : -1;
    case kQ8_0:
      return q.type == ffi::S8 && qd[1] == k_len && block_scales ? panels : -1;
    case kQ4_1:
      return q.type == ffi::U8 && 2 * qd[1] == k_len && block_scales && m.type == ffi::F16 &&
                     m.dims.size() == 3 && m.count() == d.count() ? panels : -1;
    case kQ4_K:
    case kQ6_K:
      return k_len % kSuper == 0 && KQuantShapes(f, panels, k_len, q, d, m) ? panels : -1;
    case kMXFP4:
      return k_len % kBlock == 0 && Dims(q, ffi::U8, {panels, k_len / 2, kPanel}) &&
                     Dims(d, ffi::U8, {panels, k_len / kBlock, kPanel}) ? panels : -1;
  }
  return -1;
}

// The calls' weight formats, for format_matmul.h's entry points.
struct Quant {
  using Format = quant_matmul::Format;
  using Weight = quant_matmul::Weight;
  static constexpr char kName[] = "quant matmul";
  static bool Valid() { return true; }
  static constexpr bool kFuses = false;  // no RowFusion (its tiles read x's rows in place)
  static constexpr auto Known = quant_matmul::Known;
  static constexpr int32_t kFormats = quant_matmul::kFormats;
  static constexpr auto Check = quant_matmul::Check;
  static Weight Of(ffi::AnyBuffer q, ffi::AnyBuffer d, ffi::AnyBuffer m, Format f, int64_t experts, int64_t e) {
    return {static_cast<const uint8_t*>(Part(q, experts, e)), Part(d, experts, e),
            f == kQ4_1 || f == kQ4_K || f == kQ6_K ? static_cast<const _Float16*>(Part(m, experts, e)) : nullptr};
  }
  static ffi::Error Run(ffi::ThreadPool& pool, const XRows& x, int64_t m_padded, const Weight* ws, const Weight* ups,
                        int64_t panels, const std::vector<int64_t>& group_rows, const RowFusion&, float* y, Format f) {
    const RowChunks chunks(group_rows.data(), int64_t(group_rows.size()), kRowChunk);
    Multiply(pool, f, x, chunks, m_padded, panels, ws, ups, y);
    return ffi::Error::Success();
  }
};
using Calls = FormatMatmul<Quant>;

}  // namespace
}  // namespace jaxserve::quant_matmul

using jaxserve::FormatMatmulBinding;
using jaxserve::GroupedBinding;
using jaxserve::quant_matmul::Calls;

// Operands: x, each weight's q, its scale (int8, fp8) or d, its m (else empty); attribute `format`:
// formats.h's quant_matmul::Format.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmul, Calls::Plain, FormatMatmulBinding<1>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulGated, Calls::Gated, FormatMatmulBinding<2>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulGrouped, Calls::Grouped, GroupedBinding());

// The weight formats' table this library was built with (formats.h): the loader checks it against
// runtime/weight_formats.py's (native_build.format_table).
extern "C" const char* JaxserveFormats() { return jaxserve::kFormatTable; }
