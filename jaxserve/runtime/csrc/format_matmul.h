// The XLA FFI entry points the two weight-format matmul kernels share (csrc/quant_matmul.cc,
// csrc/dot_matmul.cc): each kernel K's three calls, written once, and their bindings.
//
//   plain:   y[M, N] = x[M, K] @ W                                (rows i32[1]: x's real rows)
//   gated:   y[M, N] = silu(x @ W_gate) * (x @ W_up)              (rows i32[1])
//   grouped: the same over row groups, each times its own weight: a mixture-of-experts layer's
//       experts, stacked [E, ...] (each operand with a leading axis of E), rows sorted by expert,
//       sizes i32[E] rows per expert (runtime/expert_matmul.py); rows past the groups' are 0.
//       Gated where the up operands are given (up's w not empty).
//
// A weight is three operands (w or q; its scale or d; m, or empty: K's file says which, per
// format); attribute `format` is an id of formats.h (K's enum Format), then K's own attributes
// Attrs (dot_matmul: `isa`). K provides: Format, Weight, kName ("dot matmul"), Known (formats.h's),
// kFormats, Valid(attrs...), Check(f, k_len, w, s, m) (the weight's panel count, or -1 unless
// well-formed for x[., K]), Of(w, s, m, f, experts, e) (expert e's weight) and Run(pool, x, ws,
// ups, panels, group_rows, y, f, attrs...) (the groups' rows times ws[g], gated with ups[g]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "operand_shape.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

template <typename K, typename... Attrs>
struct FormatMatmul {
  using Format = typename K::Format;

  static ffi::Error Plain(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                          ffi::AnyBuffer m, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                          int32_t format, Attrs... attrs) {
    if (!K::Known(format)) return UnknownFormat("", format);
    const int64_t panels = Valid(x, rows, attrs...) ? K::Check(Format(format), x.dimensions()[1], w, s, m) : -1;
    if (panels < 0) return Invalid("", "a weight of its format (quant.py), rows[1]");
    const typename K::Weight wt = K::Of(w, s, m, Format(format), 1, 0);
    return K::Run(pool, x, &wt, nullptr, panels, OneGroup(x, rows), y->typed_data(), Format(format), attrs...);
  }

  static ffi::Error Gated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                          ffi::AnyBuffer mg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer mu,
                          ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t format, Attrs... attrs) {
    if (!K::Known(format)) return UnknownFormat("gated ", format);
    const Format f = Format(format);
    const int64_t panels = Valid(x, rows, attrs...) ? K::Check(f, x.dimensions()[1], wg, sg, mg) : -1;
    if (panels < 0 || K::Check(f, x.dimensions()[1], wu, su, mu) != panels)
      return Invalid("gated ", "two weights of its format alike, rows[1]");
    const typename K::Weight g = K::Of(wg, sg, mg, f, 1, 0), u = K::Of(wu, su, mu, f, 1, 0);
    return K::Run(pool, x, &g, &u, panels, OneGroup(x, rows), y->typed_data(), f, attrs...);
  }

  static ffi::Error Grouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                            ffi::AnyBuffer mg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer mu,
                            ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y, int32_t format,
                            Attrs... attrs) {
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
    std::vector<typename K::Weight> ws, ups;
    std::vector<int64_t> rows(experts);
    int64_t left = x.dimensions()[0];  // negative sizes as 0; all groups within x's rows
    for (int64_t e = 0; e < experts; ++e) {
      left -= rows[e] = std::clamp<int64_t>(sizes.typed_data()[e], 0, left);
      ws.push_back(K::Of(wg, sg, mg, f, experts, e));
      if (gated) ups.push_back(K::Of(wu, su, mu, f, experts, e));
    }
    return K::Run(pool, x, ws.data(), gated ? ups.data() : nullptr, panels, rows, y->typed_data(), f, attrs...);
  }

 private:
  static bool Valid(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rows, Attrs... attrs) {
    return x.dimensions().size() == 2 && K::Valid(attrs...) && rows.element_count() == 1;
  }

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

// Binding b, then `Weights` weights' three operands each, rows (or sizes) i32, y f32[M, N] and
// attribute `format`.
template <int Weights, typename B>
auto WithWeights(B b) {
  if constexpr (Weights == 0) {
    return std::move(b)
        .template Arg<ffi::Buffer<ffi::S32>>()  // rows[1], or sizes[E]
        .template Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
        .template Attr<int32_t>("format");
  } else {
    return WithWeights<Weights - 1>(std::move(b)
                                        .template Arg<ffi::AnyBuffer>()    // w (or q)
                                        .template Arg<ffi::AnyBuffer>()    // its scale, d or exponents; or empty
                                        .template Arg<ffi::AnyBuffer>());  // its m; or empty
  }
}

// The calls' bindings, before K's own attributes: the pool, x f32[M, K], then WithWeights' (Plain:
// one weight; Gated and Grouped: two, the gate's then the up weight's).
template <int Weights>
auto FormatMatmulBinding() {
  return WithWeights<Weights>(BindPoolF32());
}

}  // namespace jaxserve
