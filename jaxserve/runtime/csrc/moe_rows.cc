// A mixture-of-experts layer's row moves around its grouped matmuls (runtime/moe.py
// grouped_experts, runtime/expert_matmul.py), as XLA FFI custom calls:
//
//   jaxserve_moe_route:   order i32[M], sizes i32[E] from group i32[M] (each row's expert; E or
//       more, or negative: no expert's): argsort(group, stable) with the expert-less rows last, and
//       the rows per expert (a counting sort: XLA:CPU's argsort takes ~50 us at M = 256)
//   jaxserve_moe_gather:  xs[M, H] = x[order[r] / k]       (x f32[T, H], order i32[M], k = M / T):
//       for the products that read sorted rows; the gated grouped matmul takes the order itself and
//       reads x's rows in place (csrc/format_matmul.h, csrc/x_rows.h)
//   jaxserve_moe_combine: out[T, H], out[t] = sum_j w[t, j] y[r(t, j)] over j = 0..k-1 in order,
//       r(t, j) the row with order[r] = t k + j (y f32[M, H], order i32[M], w f32[T, k])
//
// `order` is the stable argsort of the rows' experts (a permutation of 0..M-1): the expert-sorted
// rows' (token, slot) indices. Why: XLA:CPU's gathers move these rows at ~8 GB/s (0.13 ms for
// y[argsort(order)] at 256 x 1024, 0.2 ms with the einsum: as long as a 64-token grouped call's
// own arithmetic takes at 4 bits); here each row is one memcpy or one pass. The sum is XLA's
// einsum("tkh,tk->th") bit for bit: a float32 FMA chain over j from 0 (tests/kernels/test_moe_rows.py).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "parallel.h"
#include "x_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::Permutation;  // checked before any row moves

ffi::Error Route(ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::S32> order, ffi::ResultBuffer<ffi::S32> sizes) {
  const int64_t m = group.element_count(), e = sizes->element_count();
  if (order->element_count() != m) return ffi::Error::InvalidArgument("moe route: expected order[M] for group[M]");
  const int32_t* g = group.typed_data();
  std::vector<int64_t> start(e + 2, 0);  // start[x + 1]: rows of expert x (x = e: no expert's)
  const auto key = [&](int64_t r) { return g[r] >= 0 && g[r] < e ? int64_t(g[r]) : e; };
  for (int64_t r = 0; r < m; ++r) ++start[key(r) + 1];
  for (int64_t x = 0; x < e; ++x) sizes->typed_data()[x] = int32_t(start[x + 1]);
  for (int64_t x = 1; x <= e + 1; ++x) start[x] += start[x - 1];
  for (int64_t r = 0; r < m; ++r) order->typed_data()[start[key(r)]++] = int32_t(r);  // in row order: stable
  return ffi::Error::Success();
}

ffi::Error Gather(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> order,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto d = x.dimensions();
  const int64_t m = order.element_count();
  if (d.size() == 2 && m == 0) return ffi::Error::Success();  // no tokens (T = 0): nothing to move
  if (d.size() != 2 || d[0] < 1 || m % d[0] != 0 || !Permutation(order.typed_data(), m))
    return ffi::Error::InvalidArgument("moe gather: expected x[T, H], order a permutation of 0..T*k-1");
  const int64_t h = d[1];
  const jaxserve::XRows rows{x.typed_data(), h, order.typed_data(), m / d[0]};
  float* yp = out->typed_data();
  constexpr int64_t kRows = 16;  // rows per work item (a row: a few KiB)
  jaxserve::ParallelFor(pool, (m + kRows - 1) / kRows, [&](int64_t i) {
    for (int64_t r = i * kRows; r < std::min(m, (i + 1) * kRows); ++r)
      std::memcpy(yp + r * h, rows(r), h * sizeof(float));
  });
  return ffi::Error::Success();
}

ffi::Error Combine(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::S32> order,
                   ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  const auto d = y.dimensions(), wd = w.dimensions();
  const int64_t m = order.element_count();
  if (d.size() != 2 || d[0] != m || wd.size() != 2 || wd[0] * wd[1] != m || !Permutation(order.typed_data(), m))
    return ffi::Error::InvalidArgument("moe combine: expected y[M, H], order a permutation of 0..M-1, w[T, k], M = T*k");
  const int64_t t_len = wd[0], k = wd[1], h = d[1];
  std::vector<int32_t> row(m);  // (token, slot) -> its row of y
  for (int64_t r = 0; r < m; ++r) row[order.typed_data()[r]] = int32_t(r);
  const float *yp = y.typed_data(), *wp = w.typed_data();
  float* op = out->typed_data();
  constexpr int64_t kTokens = 4;
  jaxserve::ParallelFor(pool, (t_len + kTokens - 1) / kTokens, [&](int64_t i) {
    for (int64_t t = i * kTokens; t < std::min(t_len, (i + 1) * kTokens); ++t) {
      float* o = op + t * h;
      int64_t c = 0;
#ifdef __AVX512F__
      for (; c + 16 <= h; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; ++j)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(yp + row[t * k + j] * h + c), _mm512_set1_ps(wp[t * k + j]), acc);
        _mm512_storeu_ps(o + c, acc);
      }
#endif
      for (; c < h; ++c) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) acc = __builtin_fmaf(yp[row[t * k + j] * h + c], wp[t * k + j], acc);
        o[c] = acc;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// group i32[M] -> order i32[M], sizes i32[E]
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeRoute, Route,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
// x[T, H], order i32[T*k] -> xs[T*k, H]
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeGather, Gather,
                              jaxserve::BindPoolF32().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
// y[M, H], order i32[M], w f32[T, k] -> out[T, H]
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeCombine, Combine,
                              jaxserve::BindPoolF32()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
