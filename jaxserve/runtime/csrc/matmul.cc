// The model's linear layers on XLA:CPU as an XLA FFI custom call: y[M, N] = x[M, K] @ W[K, N],
// float32, with W stored once, at load time, as 64-column panels: w[N / 64, K, 64]
// (cpu_kernels.pack_kernel).
//
// Why: at the batch sizes of decoding (1-64 rows) XLA:CPU's dot repacks the weight matrix on
// every call and reaches 70-170 GFLOP/s here; reading pre-packed panels this reaches 130-200
// (M = 8-64) and twice XLA's rate at M = 1 (`jaxserve bench matmul`). The micro-kernel keeps an
// MR x 64 block of y in 4 * MR AVX-512 registers and streams a panel (K x 256 contiguous bytes,
// which stays in L2) through it while the row blocks of x pass over it.
//
// Every y[i, j] is the sum over k in order 0..K-1 of fused multiply-adds, whatever M is and
// however the work is split: a row's result does not depend on the other rows of the batch.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using v16 = float __attribute__((vector_size(64)));
constexpr int kW = 16;       // floats per vector
constexpr int kPanel = 64;   // columns per work item panel (4 vectors)
constexpr int kMR = 6;       // rows per micro-kernel call
constexpr int kRowChunk = 48;  // rows per work item (a multiple of kMR)

inline v16 LoadU(const float* src) {
  v16 x;
  std::memcpy(&x, src, sizeof(x));
  return x;
}

// y[0:MR, 0:64] = x[0:MR, :] @ panel[K, 64]; rows of x are K apart, rows of y N apart.
template <int MR>
void Kernel(const float* x, const float* w, float* y, int64_t k_len, int64_t n) {
  constexpr int NV = kPanel / kW;
  v16 c[MR][NV] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    const float* wr = w + k * kPanel;
    v16 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = LoadU(wr + v * kW);
    for (int r = 0; r < MR; ++r) {
      const float a = x[r * k_len + k];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(y + r * n + v * kW, &c[r][v], sizeof(v16));
}

void Rows(const float* x, const float* w, float* y, int64_t rows, int64_t k_len, int64_t n) {
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) Kernel<kMR>(x + r * k_len, w, y + r * n, k_len, n);
  const float* xr = x + r * k_len;
  float* yr = y + r * n;
  switch (rows - r) {
    case 1: return Kernel<1>(xr, w, yr, k_len, n);
    case 2: return Kernel<2>(xr, w, yr, k_len, n);
    case 3: return Kernel<3>(xr, w, yr, k_len, n);
    case 4: return Kernel<4>(xr, w, yr, k_len, n);
    case 5: return Kernel<5>(xr, w, yr, k_len, n);
    default: return;
  }
}

// Only the first rows[0] rows of x are computed (the step's real tokens); the padding rows of y
// are zero.
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] != kPanel || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("matmul: expected x[M, K], packed w[N / 64, K, 64] and rows[1]");
  const int64_t k_len = xd[1], panels = wd[0], n = panels * kPanel;
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  std::memset(yp + m * n, 0, (xd[0] - m) * n * sizeof(float));
  const int64_t chunks = (m + kRowChunk - 1) / kRowChunk;
  // Work item = (row chunk, panel), panels fastest: threads share x's rows and split w.
  jaxserve::ParallelFor(pool, panels * chunks, [&](int64_t i) {
    const int64_t panel = i % panels, r0 = (i / panels) * kRowChunk;
    Rows(xp + r0 * k_len, wp + panel * k_len * kPanel, yp + r0 * n + panel * kPanel,
         std::min<int64_t>(kRowChunk, m - r0), k_len, n);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w[N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]: real rows of x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y[M, N]
