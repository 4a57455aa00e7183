// Greedy sampling on XLA:CPU as an XLA FFI custom call: the index of each row's largest logit
// (the first one among ties, as argmax). XLA:CPU's TopK(1) takes 4.4 ms at 64 x 49152, this one
// pass over the 12.6 MB ~0.5 ms.

#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kW;
using jaxserve::v16;
using i16 = jaxserve::i32x16;

int32_t RowArgmax(const float* x, int64_t n) {
  int64_t j = 0;
  int32_t best_i = 0;
  float best = x[0];
  if (n >= kW) {
    v16 bv;
    std::memcpy(&bv, x, sizeof(bv));
    i16 bi, idx;
    for (int c = 0; c < kW; ++c) bi[c] = c;
    idx = bi;
    for (j = kW; j + kW <= n; j += kW) {
      v16 xv;
      std::memcpy(&xv, x + j, sizeof(xv));
      idx += kW;
      const i16 gt = xv > bv;  // strictly greater: each lane keeps its first maximum
      bv = gt ? xv : bv;
      bi = gt ? idx : bi;
    }
    best = bv[0], best_i = bi[0];
    for (int c = 1; c < kW; ++c)
      if (bv[c] > best || (bv[c] == best && bi[c] < best_i)) best = bv[c], best_i = bi[c];
  }
  for (; j < n; ++j)
    if (x[j] > best) best = x[j], best_i = static_cast<int32_t>(j);
  return best_i;
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1) return ffi::Error::InvalidArgument("argmax: expected x[S, V] with V >= 1");
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  const int64_t rows = d[0], n = d[1];
  jaxserve::ParallelFor(pool, rows, [&](int64_t r) { op[r] = RowArgmax(xp + r * n, n); });
  return ffi::Error::Success();
}

}  // namespace

// x[S, V] -> [S]
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveArgmax, Argmax, jaxserve::BindPoolF32().Ret<ffi::Buffer<ffi::S32>>());
