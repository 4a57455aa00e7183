// Linear layers on the CPU's dot-product instructions, as XLA FFI custom calls:
//
//   jaxserve_dot_matmul:       y[M, N] = x[M, K] @ W
//   jaxserve_dot_matmul_gated: y[M, N] = silu(x @ W_gate) * (x @ W_up)
//   jaxserve_dot_matmul_grouped: the same over row groups, each times its own weight: a mixture-of-
//       experts layer's experts, stacked [E, ...] (each operand with a leading axis of E), rows sorted
//       by expert, sizes i32[E] rows per expert (runtime/expert_matmul.py); rows past the groups' are 0;
//       with an order i32[M], x's rows read in sorted order as they are prepared (format_matmul.h)
//
// W is held in the 64-column panels of csrc/matmul.cc with consecutive k values interleaved, so one
// 32-bit lane holds what one dot-product step of one column needs (attribute `format`: an id of
// formats.h, generated from runtime/weight_formats.py's records):
//   kBFLOAT16: w u16[N / 64, K / 2, 128] bfloat16 bits, [p, i, 2 j + t] = W[2 i + t, 64 p + j].
//           x is rounded to bfloat16 (to nearest even) and y[i, j] is summed over the k pairs in
//           order, float32 accumulation, as AVX512_BF16's vdpbf16ps does (bf16 products are exact).
//   kW8A8: w u8[N / 64, K / 4, 256] holding q + 128, [p, i, 4 j + t] = q[4 i + t, 64 p + j] + 128
//           (q int8, W = q * scale[n]); scale f32[N]. x is quantized on the fly in blocks of 32
//           along k (GGUF Q8_0's activation blocks), symmetric: sx = max |x_block| / 127, xq =
//           rint(x * (127 / max |x_block|)). Each block's sum of xq q is exact int32 arithmetic
//           (AVX512_VNNI's vpdpbusd takes the unsigned operand: q + 128, and starts from
//           -128 * sum xq), so its order is irrelevant; the blocks' float(sum) * sx are added in
//           k order, and y = that * scale[n].
//   kW4A8: w u8[N / 64, K / 8, 256] GGUF Q4_1's 4-bit values (Q4_0's too: m = -8 d), a k quad a
//           32-bit lane as w8a8's, two quads a byte: [p, g, 4 j + t] = q[8 g + t, 64 p + j] |
//           q[8 g + 4 + t, 64 p + j] << 4 (q in 0..15); d and m f16[N / 64, K / 32, 64]: W = q d + m
//           per block of 32 k. x is quantized as w8a8's, and each block adds
//           sx (d sum(xq q) + m sum(xq)) to the float32 sum, in k order (llama.cpp's Q4_1 x Q8_1).
//   kQ8A8: GGUF Q8_0's blocks in w8a8's layout (q + 128 in quads), d and m = -128 d as w4a8's
//           (W = (q + 128) d + m = q d): the w4a8 block sum on whole bytes (llama.cpp's Q8_0 x Q8_0).
//   kMXFP4A8: MXFP4's e2m1 codes (runtime/mxfp4.py) in w4a8's nibble layout, and the blocks' E8M0
//           exponents e u8[N / 64, K / 32, 64]: W = e2m1(c) 2^(e - 127). x is quantized as w8a8's;
//           each code becomes the byte 2 e2m1(c) + 12 (a 16-entry table, csrc/mxfp4a8.h) and each
//           block adds sum(xq 2 e2m1(c)) (exact int32, from -12 sum xq) times 2^(e - 128) sx.
// Attribute `isa` (cpu_kernels.choose_isa: the backend's choice from the CPU's flags): 1 the
// instructions named above, 0 portable vector code (any CPU: AVX2 or whatever the build targets)
// that computes the same sums in the same order, 2 AMX tiles (tdpbf16ps / tdpbsud on 16-row tiles
// of activations against 16-column tiles of the same panels; K a multiple of 32, else isa 1 runs).
// AMX's W8A8 block sums are the same exact integers, so its results are isa 1's bits; its bf16
// pairs are summed in the tile unit's own order (float32 rounding, not vdpbf16ps' bits).
// A row's result never depends on the other rows: every row of a call runs the same path.
//
// Where: the activations' preparation csrc/dot_acts.h; the isa 0 / 1 kernels csrc/dot_tile.h, isa
// 2's csrc/dot_amx.h; the work loop csrc/dot_run.h (bf16 on AMX: csrc/dot_amx_run.h); the calls'
// entry points format_matmul.h's; here the formats' checks and the calls' bindings.

#include <cerrno>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "dot_acts.h"
#include "dot_matmul.h"
#include "dot_run.h"
#include "format_matmul.h"
#include "formats.h"
#include "operand_shape.h"
#include "x_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve::dot_matmul {
namespace {

// The weight's panel count if (w, scale, mins) is a well-formed weight of format f for x[., K],
// else -1.
int64_t Check(Format f, int64_t k_len, const Shape& w, const Shape& scale, const Shape& mins) {
  const auto& wd = w.dims;
  const int64_t per = f == kBFLOAT16 ? 2 : Nibbled(f) ? 8 : 4;  // k values per 32-bit lane (w4a8: per byte pair of quads)
  if (wd.size() != 3 || k_len % per != 0 || wd[1] != k_len / per || wd[2] != kPanel * (f == kBFLOAT16 ? 2 : 4)) return -1;
  if (f == kBFLOAT16) return w.type == ffi::BF16 ? wd[0] : -1;
  if (w.type != ffi::U8 || k_len % kBlock != 0) return -1;
  if (f == kW8A8)
    return scale.type == ffi::F32 && scale.count() == wd[0] * kPanel ? wd[0] : -1;
  if (f == kMXFP4A8) {  // exponents u8[N / 64, K / 32, 64]
    const auto& ed = scale.dims;
    return scale.type == ffi::U8 && ed.size() == 3 && ed[0] == wd[0] && ed[1] == k_len / kBlock && ed[2] == kPanel
               ? wd[0] : -1;
  }
  const auto blocks = [&](const Shape& b) {
    const auto& bd = b.dims;
    return b.type == ffi::F16 && bd.size() == 3 && bd[0] == wd[0] && bd[1] == k_len / kBlock &&
           bd[2] == kPanel;
  };
  return blocks(scale) && blocks(mins) ? wd[0] : -1;
}

// The calls' weight formats and instructions (attribute `isa`), for format_matmul.h's entry points.
struct Dot {
  using Format = dot_matmul::Format;
  using Weight = dot_matmul::Weight;
  static constexpr char kName[] = "dot matmul";
  static bool Valid(int32_t isa) { return isa == kPortable || isa == kDot || isa == kAmx; }
  static constexpr bool kFuses = true;  // the norm as the rows are prepared, the residual as tiles are written
  static constexpr auto Known = dot_matmul::Known;
  static constexpr int32_t kFormats = dot_matmul::kFormats;
  static constexpr auto Check = dot_matmul::Check;

  static Weight Of(ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer mins, Format, int64_t experts, int64_t e) {
    const void* s = Part(scale, experts, e);
    return {static_cast<const uint32_t*>(Part(w, experts, e)), static_cast<const float*>(s),
            static_cast<const _Float16*>(s), static_cast<const _Float16*>(Part(mins, experts, e)),
            static_cast<const uint8_t*>(s)};
  }

  // The caller thread's activations buffer for calls of format f and x[., k_len] (the pool tasks
  // are done with it when Run returns). One per shape, so row r of a shape's calls lies at the same
  // place call after call and step after step, where the core whose share it is wrote it last: with
  // one buffer for all, rows moved with each call's row length (576 or 1536 k), and half of them
  // landed on lines the other core had written (a cross-core transfer each, ~350 ns on a VM whose
  // vCPUs sit far apart; bench/core_link.py).
  static Acts& ActsFor(Format f, int64_t k_len) {
    thread_local std::vector<std::pair<int64_t, std::unique_ptr<Acts>>> by_shape;
    const int64_t key = k_len * 8 + int64_t(f);
    for (auto& [k, a] : by_shape)
      if (k == key) return *a;
    by_shape.emplace_back(key, std::make_unique<Acts>());
    return *by_shape.back().second;
  }

  // x's rows as groups (group_rows: rows per group, in order; one group: a plain matmul) times ws
  // (and ups), into y's m_padded rows.
  static ffi::Error Run(ffi::ThreadPool& pool, const XRows& x, int64_t m_padded, const Weight* ws, const Weight* ups,
                        int64_t panels, const std::vector<int64_t>& group_rows, const RowFusion& fused, float* y,
                        Format f, int32_t isa) {
    int64_t m = 0;
    for (int64_t r : group_rows) m += r;
    if ((isa == kDot && !(f == kBFLOAT16 ? kHaveBf16 : kHaveVnni)) || (isa == kAmx && !kHaveAmx))
      return ffi::Error::InvalidArgument("dot matmul: an isa asked of a library built without its instructions");
    if (isa == kAmx && x.k_len % 32 != 0) isa = kDot;  // a tile takes 32 k at a time (per shape, not batch)
    Acts& acts = ActsFor(f, x.k_len);
    Prepare(pool, f, x, m, fused, acts);
#ifdef JAXSERVE_AMX
    if (isa == kAmx) Multiply<kAmx>(pool, f, acts, group_rows, m_padded, panels, ws, ups, y, fused.residual);
#endif
    if (isa == kDot) Multiply<kDot>(pool, f, acts, group_rows, m_padded, panels, ws, ups, y, fused.residual);
    if (isa == kPortable) Multiply<kPortable>(pool, f, acts, group_rows, m_padded, panels, ws, ups, y, fused.residual);
    return ffi::Error::Success();
  }
};
using Calls = FormatMatmul<Dot, int32_t>;

}  // namespace
}  // namespace jaxserve::dot_matmul

using jaxserve::dot_matmul::kHaveAmx;
using jaxserve::dot_matmul::kHaveBf16;
using jaxserve::dot_matmul::kHaveVnni;

// Which `isa = 1` paths this build has: bit 0 bf16 (AVX512_BF16), bit 1 w8a8, w4a8, q8a8 and
// mxfp4a8 (AVX512_VNNI); bit 2: `isa = 2` (AMX tiles, every format).
extern "C" int JaxserveDotIsa() { return (kHaveBf16 ? 1 : 0) | (kHaveVnni ? 2 : 0) | (kHaveAmx ? 4 : 0); }

// Asks Linux for this process's use of the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, once,
// for every thread): 0 granted, else the errno (a kernel before 5.16, or a signal stack too small
// for the tile state), and -1 where the library has no AMX path. isa 2 needs it granted.
extern "C" int JaxserveAmxPermit() {
  if (!kHaveAmx) return -1;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0 ? 0 : errno;
}

using jaxserve::FormatMatmulBinding;
using jaxserve::GroupedBinding;
using jaxserve::dot_matmul::Calls;

// Operands: x, each weight's w, its scale (w8a8), d (w4a8, q8a8) or exponents (mxfp4a8), its m
// (w4a8, q8a8; else empty), rows, then (plain and gated) norm and residual (format_matmul.h's
// RowFusion); attributes `format` (formats.h's dot_matmul::Format), (plain and gated) `eps`, `isa`.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmul, Calls::Plain, FormatMatmulBinding<1>().Attr<int32_t>("isa"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmulGated, Calls::Gated, FormatMatmulBinding<2>().Attr<int32_t>("isa"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmulGrouped, Calls::Grouped, GroupedBinding().Attr<int32_t>("isa"));
