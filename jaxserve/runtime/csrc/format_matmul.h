// The XLA FFI entry points the two weight-format matmul kernels share (csrc/quant_matmul.cc,
// csrc/dot_matmul.cc): each kernel K's three calls, written once, and their bindings.
//
//   plain:   y[M, N] = x[M, K] @ W                                (rows i32[1]: x's real rows)
//   gated:   y[M, N] = silu(x @ W_gate) * (x @ W_up)              (rows i32[1])
//       Both with the decoder's row operations fused in (RowFusion), each operand f32 and empty where
//       unused: `norm` [K], x's rows RMS-normed first (x * rsqrt(mean(x^2) + eps) * norm, attribute
//       `eps`), and `residual` [M, N], added to the product (y = residual + ...). Where a kernel
//       has none (K::kFuses false) they must be empty.
//   grouped: the same over row groups, each times its own weight: a mixture-of-experts layer's
//       experts, stacked [E, ...] (each operand with a leading axis of E), rows sorted by expert,
//       sizes i32[E] rows per expert (runtime/expert_matmul.py); rows past the groups' are 0.
//       Gated where the up operands are given (up's w not empty). Operand order i32[M] (or i32[0]:
//       none): x is then the layer's tokens x[T, K] and sorted row r is x[order[r] / k], k = M / T,
//       read in place (csrc/x_rows.h; order: a permutation of 0..M-1), y[M, N].
//
// A weight is three operands (w or q; its scale or d; m, or empty: K's file says which, per
// format); attribute `format` is an id of formats.h (K's enum Format), then K's own attributes
// Attrs (dot_matmul: `isa`). K provides: Format, Weight, kName ("dot matmul"), Known (formats.h's),
// kFormats, Valid(attrs...), Check(f, k_len, w, s, m) (the weight's panel count, or -1 unless
// well-formed for x[., K]), Of(w, s, m, f, experts, e) (expert e's weight) and Run(pool, x, m, ws,
// ups, panels, group_rows, fused, y, f, attrs...) (x's rows, an XRows, as groups times ws[g], gated
// with ups[g], with the RowFusion `fused`; y's m rows past the groups' 0, or the residual's).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "formats.h"
#include "operand_shape.h"
#include "parallel.h"
#include "x_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

// What a plain or gated call fuses into its rows (null: nothing): the RMS norm's scale [K] and
// eps, applied to x's rows as they are read; the residual [M, N], added to y's rows as they are
// written (by the core that computed them, which wrote the rows the next layer norms: no XLA
// elementwise pass between the calls).
struct RowFusion {
  const float* norm = nullptr;
  float eps = 0;
  const float* residual = nullptr;
};

template <typename K, typename... Attrs>
struct FormatMatmul {
  using Format = typename K::Format;

  static ffi::Error Plain(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                          ffi::AnyBuffer m, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> norm,
                          ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> y, int32_t format, float eps,
                          Attrs... attrs) {
    if (!K::Known(format)) return UnknownFormat("", format);
    const int64_t panels = Valid(x, rows, attrs...) ? K::Check(Format(format), x.dimensions()[1], w, s, m) : -1;
    if (panels < 0) return Invalid("", "a weight of its format (quant.py), rows[1]");
    RowFusion fused;
    if (!Fusion(x, panels, norm, residual, eps, fused)) return BadFusion("");
    const typename K::Weight wt = K::Of(w, s, m, Format(format), 1, 0);
    return K::Run(pool, Rows(x), x.dimensions()[0], &wt, nullptr, panels, OneGroup(x, rows), fused, y->typed_data(),
                  Format(format), attrs...);
  }

  static ffi::Error Gated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                          ffi::AnyBuffer mg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer mu,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::F32> residual,
                          ffi::ResultBuffer<ffi::F32> y, int32_t format, float eps, Attrs... attrs) {
    if (!K::Known(format)) return UnknownFormat("gated ", format);
    const Format f = Format(format);
    const int64_t panels = Valid(x, rows, attrs...) ? K::Check(f, x.dimensions()[1], wg, sg, mg) : -1;
    if (panels < 0 || K::Check(f, x.dimensions()[1], wu, su, mu) != panels)
      return Invalid("gated ", "two weights of its format alike, rows[1]");
    RowFusion fused;
    if (!Fusion(x, panels, norm, residual, eps, fused)) return BadFusion("gated ");
    const typename K::Weight g = K::Of(wg, sg, mg, f, 1, 0), u = K::Of(wu, su, mu, f, 1, 0);
    return K::Run(pool, Rows(x), x.dimensions()[0], &g, &u, panels, OneGroup(x, rows), fused, y->typed_data(), f,
                  attrs...);
  }

  static ffi::Error Grouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                            ffi::AnyBuffer mg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer mu,
                            ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> order, ffi::ResultBuffer<ffi::F32> y,
                            int32_t format, Attrs... attrs) {
    if (!K::Known(format)) return UnknownFormat("grouped ", format);
    const Format f = Format(format);
    const int64_t experts = sizes.element_count(), gated = wu.element_count() > 0;
    // Expert 0's weight's panels if the operands are a well-formed stack, else -1.
    const auto stacked = [&](ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::AnyBuffer m) -> int64_t {
      if (!Stacked({w, s, m}, experts)) return -1;
      return K::Check(f, x.dimensions()[1], Shape(w, 1), Shape(s, 1), Shape(m, 1));
    };
    const bool valid = x.dimensions().size() == 2 && K::Valid(attrs...) && experts > 0;
    const int64_t panels = valid ? stacked(wg, sg, mg) : -1;
    if (panels < 0 || (gated && stacked(wu, su, mu) != panels))
      return Invalid("grouped ", "stacked weights [E, ...] of its format (runtime/expert_matmul.py), sizes i32[E]");
    const int64_t tokens = x.dimensions()[0], m = order.element_count() ? order.element_count() : tokens;
    if ((order.element_count() && (tokens < 1 || m % tokens || !Permutation(order.typed_data(), m))) ||
        y->dimensions().size() != 2 || y->dimensions()[0] != m)
      return ffi::Error::InvalidArgument(std::string("grouped ") + K::kName + ": expected x[T, K], order i32[M] a " +
                                         "permutation of 0..M-1, M a multiple of T, and y[M, N] (or order i32[0]: " +
                                         "x's rows as sorted, M = T)");
    const XRows xs = order.element_count() ? XRows{x.typed_data(), x.dimensions()[1], order.typed_data(), m / tokens}
                                           : Rows(x);
    std::vector<typename K::Weight> ws, ups;
    std::vector<int64_t> rows(experts);
    int64_t left = m;  // negative sizes as 0; all groups within the call's rows
    for (int64_t e = 0; e < experts; ++e) {
      left -= rows[e] = std::clamp<int64_t>(sizes.typed_data()[e], 0, left);
      ws.push_back(K::Of(wg, sg, mg, f, experts, e));
      if (gated) ups.push_back(K::Of(wu, su, mu, f, experts, e));
    }
    return K::Run(pool, xs, m, ws.data(), gated ? ups.data() : nullptr, panels, rows, RowFusion{}, y->typed_data(), f,
                  attrs...);
  }

 private:
  static bool Valid(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rows, Attrs... attrs) {
    return x.dimensions().size() == 2 && K::Valid(attrs...) && rows.element_count() == 1;
  }

  // The call's RowFusion from its operands, if each is empty or of its shape (norm [K], residual
  // [M, N]) and the kernel fuses them (K::kFuses) where any is given.
  static bool Fusion(ffi::Buffer<ffi::F32> x, int64_t panels, ffi::Buffer<ffi::F32> norm,
                     ffi::Buffer<ffi::F32> residual, float eps, RowFusion& fused) {
    const auto& xd = x.dimensions();
    const auto& rd = residual.dimensions();
    const bool has_norm = norm.element_count() > 0, has_residual = residual.element_count() > 0;
    if (has_norm && (norm.element_count() != xd[1] || !(eps >= 0))) return false;
    if (has_residual && (rd.size() != 2 || rd[0] != xd[0] || rd[1] != panels * kPanel)) return false;
    if ((has_norm || has_residual) && !K::kFuses) return false;
    fused = {has_norm ? norm.typed_data() : nullptr, eps, has_residual ? residual.typed_data() : nullptr};
    return true;
  }

  static ffi::Error BadFusion(const char* call) {
    return ffi::Error::InvalidArgument(std::string(call) + K::kName + ": expected norm f32[K] and residual f32[M, N] " +
                                       (K::kFuses ? "or empty, eps >= 0" : "empty (this kernel fuses neither)"));
  }

  // x's rows as given.
  static XRows Rows(ffi::Buffer<ffi::F32> x) { return {x.typed_data(), x.dimensions()[1]}; }

  // One group: a call's first `rows` rows (clamped to x's).
  static std::vector<int64_t> OneGroup(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rows) {
    return {std::clamp<int64_t>(rows.typed_data()[0], 0, x.dimensions()[0])};
  }

  static ffi::Error Invalid(const char* call, const char* want) {
    return ffi::Error::InvalidArgument(std::string(call) + K::kName + ": expected x[M, K], " + want);
  }

  // A `format` that is not one of formats.h's ids (the caller and the library disagree on the table).
  static ffi::Error UnknownFormat(const char* call, int32_t format) {
    return ffi::Error::InvalidArgument(std::string(call) + K::kName + ": unknown weight format id " +
                                       std::to_string(format) + " (formats.h, from runtime/weight_formats.py, has 0.." +
                                       std::to_string(K::kFormats - 1) + ")");
  }
};

// Binding b, then `Weights` weights' three operands each, rows[1] (grouped: sizes[E] and order[M]
// or [0]) i32, (plain and gated) norm and residual f32, y f32[M, N] and attribute `format` (plain and
// gated: then `eps`).
template <int Weights, bool Grouped, typename B>
auto WithWeights(B b) {
  if constexpr (Weights > 0) {
    return WithWeights<Weights - 1, Grouped>(std::move(b)
                                                 .template Arg<ffi::AnyBuffer>()    // w (or q)
                                                 .template Arg<ffi::AnyBuffer>()    // its scale, d or exponents
                                                 .template Arg<ffi::AnyBuffer>());  // its m (either may be empty)
  } else if constexpr (Grouped) {
    return std::move(b)
        .template Arg<ffi::Buffer<ffi::S32>>()  // sizes[E]
        .template Arg<ffi::Buffer<ffi::S32>>()  // order[M] or [0]
        .template Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
        .template Attr<int32_t>("format");
  } else {
    return std::move(b)
        .template Arg<ffi::Buffer<ffi::S32>>()  // rows[1]
        .template Arg<ffi::Buffer<ffi::F32>>()  // norm[K] or [0]
        .template Arg<ffi::Buffer<ffi::F32>>()  // residual[M, N] or [0]
        .template Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
        .template Attr<int32_t>("format")
        .template Attr<float>("eps");
  }
}

// The calls' bindings, before K's own attributes: the pool, x f32[M, K] (grouped with an order:
// [T, K]), then WithWeights' (Plain: one weight; Gated and Grouped: two, the gate's then the up
// weight's).
template <int Weights>
auto FormatMatmulBinding() {
  return WithWeights<Weights, false>(BindPoolF32());
}
// Grouped's (gate and up weights, sizes, order).
inline auto GroupedBinding() { return WithWeights<2, true>(BindPoolF32()); }

}  // namespace jaxserve
