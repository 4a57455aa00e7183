// The model's linear layers on XLA:CPU as XLA FFI custom calls, float32, with every weight W[K, N]
// stored once, at load time, as 64-column panels: w[N / 64, K, 64] (cpu_kernels.pack_kernel).
//
//   jaxserve_matmul:       y[M, N] = x[M, K] @ W
//   jaxserve_matmul_gated: y[M, N] = silu(x @ W_gate) * (x @ W_up), the MLP's gate and up
//                          projections with SiLU-and-multiply applied to each 6 x 64 tile as it is
//                          computed (one call, no [M, N] intermediates, no separate elementwise pass)
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

#include "formats.h"
#include "parallel.h"
#include "row_tiles.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kW;
using jaxserve::LoadU;
using jaxserve::v16;
using jaxserve::kPanel;  // columns per work item panel (4 vectors; formats.h)
constexpr int kMR = 6;       // rows per micro-kernel call
constexpr int kRowChunk = 48;  // rows per work item (a multiple of kMR)

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

// Kernel<MR> for any 0 < MR <= kMR.
inline void Tile(int64_t mr, const float* x, const float* w, float* y, int64_t k_len, int64_t n) {
  switch (mr) {
    case 1: return Kernel<1>(x, w, y, k_len, n);
    case 2: return Kernel<2>(x, w, y, k_len, n);
    case 3: return Kernel<3>(x, w, y, k_len, n);
    case 4: return Kernel<4>(x, w, y, k_len, n);
    case 5: return Kernel<5>(x, w, y, k_len, n);
    case 6: return Kernel<6>(x, w, y, k_len, n);
    default: return;
  }
}
static_assert(kMR == 6, "Tile covers MR = 1..6");

// y[0:rows, 0:64] = x[0:rows, :] @ panel, or silu(x @ gate panel) * (x @ up panel) where w_up (SiLU
// and the product applied to each 6 x 64 tile as it is computed); rows of x K apart, of y N apart.
void Rows(const float* x, const float* w, const float* w_up, float* y, int64_t rows, int64_t k_len, int64_t n) {
  jaxserve::RowTiles<kMR>(0, rows, w_up != nullptr, y, n, [&](int64_t mr, int64_t r, bool up, float* dst, int64_t ldd) {
    Tile(mr, x + r * k_len, up ? w_up : w, dst, k_len, ldd);
  });
}

// One call's work: y[M, N] from x[M, K] and one packed weight w (gated: w and w_up, alike).
// Work item = (row chunk, panel), panels fastest: the threads share x's rows and split the
// weights. Only the first `m` rows of x are computed (the step's real tokens); the padding rows of
// y are zero.
struct Call {
  const float* x;
  int64_t m, m_padded, k_len, panels;
  const float* w;
  const float* w_up;  // gated only
  float* y;
};

void Run(ffi::ThreadPool& pool, const Call& c) {
  const int64_t n = c.panels * kPanel, chunks = (c.m + kRowChunk - 1) / kRowChunk, wsize = c.k_len * kPanel;
  std::memset(c.y + c.m * n, 0, (c.m_padded - c.m) * n * sizeof(float));
  jaxserve::ParallelFor(pool, c.panels * chunks, [&](int64_t i) {
    const int64_t panel = i % c.panels, r0 = (i / c.panels) * kRowChunk, rows = std::min<int64_t>(kRowChunk, c.m - r0);
    const float* x = c.x + r0 * c.k_len;
    float* y = c.y + r0 * n + panel * kPanel;
    Rows(x, c.w + panel * wsize, c.w_up ? c.w_up + panel * wsize : nullptr, y, rows, c.k_len, n);
  }, /*uniform=*/true);
}

// w's panel count if it is x[M, K]'s packed weight [N / 64, K, 64], else -1.
int64_t Panels(ffi::Buffer<ffi::F32> w, int64_t k_len) {
  const auto wd = w.dimensions();
  return wd.size() == 3 && wd[1] == k_len && wd[2] == kPanel ? wd[0] : -1;
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const int64_t panels = xd.size() == 2 ? Panels(w, xd[1]) : -1;
  if (panels < 0 || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("matmul: expected x[M, K], packed w[N / 64, K, 64] and rows[1]");
  Run(pool, {x.typed_data(), std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]), xd[0], xd[1], panels,
             w.typed_data(), nullptr, y->typed_data()});
  return ffi::Error::Success();
}

ffi::Error GatedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w_gate,
                       ffi::Buffer<ffi::F32> w_up, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const int64_t panels = xd.size() == 2 ? Panels(w_gate, xd[1]) : -1;
  if (panels < 0 || Panels(w_up, xd[1]) != panels || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("gated matmul: expected x[M, K], two packed w[N / 64, K, 64] alike, rows[1]");
  Run(pool, {x.typed_data(), std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]), xd[0], xd[1], panels,
             w_gate.typed_data(), w_up.typed_data(), y->typed_data()});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              jaxserve::BindPoolF32()            // x[M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w[N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]: real rows of x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y[M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulGated, GatedMatmul,
                              jaxserve::BindPoolF32()            // x[M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_gate[N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_up[N / 64, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]: real rows of x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y[M, N]
