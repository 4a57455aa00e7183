// RoPE inside the native calls that read a layer's freshly projected rows: the attention call
// rotates each query vector as it loads it (csrc/attention_tiles.h), the KV write each key row
// before it stores it (csrc/kv_write.cc). So no XLA op sits between the q/k/v projections and
// attention, and each row is rotated where it is read (runtime/rope_fusion.py).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// The tables of model/layers.py's `rope_tables`, one row per token of the call: cos and signed
// sin (-sin on the first half, sin on the second) over the first `rot` dims of a head vector, the
// rest passing through unrotated (partial rotary). rot == 0: no RoPE.
struct Rope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t rot = 0;

  // dst[e] = (x rotated as token t's)[e] * scale, e < d: HF's rotate-half convention,
  // x[e] cos[e] + x[e +- rot / 2] sin[e], as model/layers.py's `apply_rope` computes it.
  void Apply(int64_t t, const float* x, int64_t d, float scale, float* dst) const;
};

// No fast-math and no FMA contraction here: two rounded products and their rounded sum, as XLA's
// ops compute `apply_rope`, so the fused path's rows equal the XLA path's bit for bit.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
inline void Rope::Apply(int64_t t, const float* x, int64_t d, float scale, float* dst) const {
  const int64_t half = rot / 2;
  const float* c = cos + t * rot;
  const float* s = sin + t * rot;
  for (int64_t e = 0; e < half; ++e) {
    const float a = x[e] * c[e], b = x[e + half] * s[e];
    dst[e] = (a + b) * scale;
  }
  for (int64_t e = half; e < rot; ++e) {
    const float a = x[e] * c[e], b = x[e - half] * s[e];
    dst[e] = (a + b) * scale;
  }
  for (int64_t e = rot; e < d; ++e) dst[e] = x[e] * scale;
}
#pragma GCC pop_options

// A call's RoPE operands: f32[0] both (none), or f32[t, R] each, R even and at most head_dim d.
inline xla::ffi::Error BindRope(const xla::ffi::Buffer<xla::ffi::F32>& cos, const xla::ffi::Buffer<xla::ffi::F32>& sin,
                                int64_t t, int64_t d, const char* call, Rope* out) {
  if (cos.element_count() == 0 && sin.element_count() == 0) return xla::ffi::Error::Success();
  const auto cd = cos.dimensions(), sd = sin.dimensions();
  if (cd.size() != 2 || sd.size() != 2 || cd[0] != t || sd[0] != t || cd[1] != sd[1] || cd[1] % 2 != 0 ||
      cd[1] <= 0 || cd[1] > d)
    return xla::ffi::Error::InvalidArgument(
        std::string(call) + ": the RoPE tables must be f32[T, R] each (T the rows, R even and at most head_dim " +
        std::to_string(d) + "), or f32[0] both for none");
  *out = Rope{cos.typed_data(), sin.typed_data(), cd[1]};
  return xla::ffi::Error::Success();
}

}  // namespace jaxserve
