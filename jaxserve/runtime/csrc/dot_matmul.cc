// Linear layers on the CPU's dot-product instructions, as XLA FFI custom calls:
//
//   jaxserve_dot_matmul:       y[M, N] = x[M, K] @ W
//   jaxserve_dot_matmul_gated: y[M, N] = silu(x @ W_gate) * (x @ W_up)
//
// W is held in the 64-column panels of csrc/matmul.cc with consecutive k values interleaved, so one
// 32-bit lane holds what one dot-product step of one column needs (attribute `fmt`, quant.py):
//   0 bf16: w u16[N / 64, K / 2, 128] bfloat16 bits, [p, i, 2 j + t] = W[2 i + t, 64 p + j].
//           x is rounded to bfloat16 (to nearest even) and y[i, j] is summed over the k pairs in
//           order, float32 accumulation, as AVX512_BF16's vdpbf16ps does (bf16 products are exact).
//   1 w8a8: w i8[N / 64, K / 4, 256], [p, i, 4 j + t] = q[4 i + t, 64 p + j]; scale f32[N];
//           colsum i32[N] = sum_k q[k, n]. Each row of x is quantized on the fly, symmetric:
//           sx = max |x| / 127, xq = rint(x / sx) (x * (127 / max |x|)); y = float(sum_k xq q) *
//           scale[n] * sx. The sum is exact int32 arithmetic (AVX512_VNNI's vpdpbusd takes
//           unsigned x: xq + 128, and 128 * colsum is taken off after), so its order is irrelevant.
// Attribute `isa` (cpu_kernels.dot_isa, chosen at run time from the CPU's flags): 1 the
// instructions named above, 0 portable vector code (any CPU: AVX2 or whatever the build targets)
// that computes the same sums in the same order. A row's result never depends on the other rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kW;
using jaxserve::v16;
using i32x16 = int32_t __attribute__((vector_size(64)));
constexpr int kPanel = 64, kNV = kPanel / kW, kMR = 6, kRowChunk = 48;

enum Fmt { kBf16 = 0, kW8A8 = 1 };
enum Isa { kPortable = 0, kDot = 1 };

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHaveBf16 = true;
#else
constexpr bool kHaveBf16 = false;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
#endif

template <typename V, typename T>
inline V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename To, typename From>
inline To Bits(From f) {
  To t;
  std::memcpy(&t, &f, sizeof(t));
  return t;
}

// Keeps -ffast-math from adding two products together before adding them to the sum.
inline void Opaque(v16& w) { asm("" : "+v"(w)); }

// float32 -> bfloat16 bits, round to nearest even (ml_dtypes' and XLA's convert; no NaN inputs).
inline uint32_t Bf16(float f) {
  const uint32_t u = Bits<uint32_t>(f);
  return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

// One step of a tile: the 64 columns' accumulators of MR rows. Each k step (a pair for bf16, a
// quad for w8a8) reads 4 vectors of the panel and one 32-bit word of each row's activations.
template <Fmt F, Isa I, int MR>
struct Tile {
  using Acc = std::conditional_t<F == kBf16, v16, i32x16>;
  Acc c[MR][kNV] = {};

  void Run(const uint32_t* x, const uint32_t* w, int64_t steps, int64_t ldx) {
    for (int64_t s = 0; s < steps; ++s) {
      i32x16 b[kNV];
      for (int v = 0; v < kNV; ++v) b[v] = Load<i32x16>(w + s * kPanel + v * kW);
      for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + s], b);
    }
  }

  inline void Step(int r, uint32_t a, const i32x16* b) {
    if constexpr (F == kBf16 && I == kDot && kHaveBf16) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a));
      for (int v = 0; v < kNV; ++v)
        c[r][v] = Bits<v16>(_mm512_dpbf16_ps(Bits<__m512>(c[r][v]), av, Bits<__m512bh>(b[v])));
    } else if constexpr (F == kBf16) {  // vdpbf16ps' order: the odd k of the pair, then the even one
      const float lo = Bits<float>(a << 16), hi = Bits<float>(a & 0xffff0000u);
      for (int v = 0; v < kNV; ++v) {
        c[r][v] += hi * Bits<v16>(b[v] & int32_t(0xffff0000u));
        Opaque(c[r][v]);
        c[r][v] += lo * Bits<v16>(b[v] << 16);
        Opaque(c[r][v]);
      }
    } else if constexpr (I == kDot && kHaveVnni) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a));
      for (int v = 0; v < kNV; ++v)
        c[r][v] = Bits<i32x16>(_mm512_dpbusd_epi32(Bits<__m512i>(c[r][v]), av, Bits<__m512i>(b[v])));
    } else {  // exact integers: any order gives the same sum
      for (int t = 0; t < 4; ++t) {
        const int32_t xt = int32_t(a >> (8 * t) & 255);
        for (int v = 0; v < kNV; ++v) c[r][v] += xt * ((b[v] << (24 - 8 * t)) >> 24);
      }
    }
  }
};

// A call's activations, prepared once for all its rows: bf16 pairs, or w8a8 quads (xq + 128) with
// each row's scale sx.
struct Acts {
  std::vector<uint32_t> words;
  std::vector<float> sx;
  int64_t ldx = 0;  // words per row
};

void Prepare(Fmt f, const float* x, int64_t m, int64_t k_len, Acts& a) {
  const int64_t per = f == kBf16 ? 2 : 4;
  a.ldx = k_len / per;
  a.words.resize(m * a.ldx);
  a.sx.resize(m);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k_len;
    uint32_t* out = a.words.data() + r * a.ldx;
    if (f == kBf16) {
      for (int64_t i = 0; i < a.ldx; ++i) out[i] = Bf16(xr[2 * i]) | Bf16(xr[2 * i + 1]) << 16;
      continue;
    }
    float amax = 0;
    for (int64_t k = 0; k < k_len; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    a.sx[r] = amax / 127.0f;
    for (int64_t i = 0; i < a.ldx; ++i) {
      uint32_t word = 0;
      for (int t = 0; t < 4; ++t) {
        const float q = std::clamp(std::nearbyint(xr[4 * i + t] * inv), -127.0f, 127.0f);
        word |= uint32_t(int32_t(q) + 128) << (8 * t);
      }
      out[i] = word;
    }
  }
}

// A weight as the kernel reads it (w8a8: with its scales and column sums).
struct Weight {
  const uint32_t* w;
  const float* scale;
  const int32_t* colsum;
};

// y[0:MR, 0:64] for one panel: the tile's sums, then (w8a8) the scales.
template <Fmt F, Isa I, int MR>
void Kernel(const Acts& a, int64_t r0, const Weight& wt, int64_t panel, float* y, int64_t ldy) {
  Tile<F, I, MR> t;
  t.Run(a.words.data() + r0 * a.ldx, wt.w + panel * a.ldx * kPanel, a.ldx, a.ldx);
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) {
      v16 out;
      if constexpr (F == kBf16) {
        out = t.c[r][v];
      } else {
        const int64_t n0 = panel * kPanel + v * kW;
        const i32x16 acc = t.c[r][v] - 128 * Load<i32x16>(wt.colsum + n0);  // sum (xq + 128) q - 128 sum q
        out = __builtin_convertvector(acc, v16) * Load<v16>(wt.scale + n0);
        Opaque(out);  // (acc * scale) * sx for every MR: -ffast-math may not regroup it per tile size
        out *= a.sx[r0 + r];
      }
      std::memcpy(y + r * ldy + v * kW, &out, sizeof(out));
    }
}

template <Fmt F, Isa I>
void Rows(int64_t mr, const Acts& a, int64_t r0, const Weight& wt, int64_t panel, float* y, int64_t ldy) {
  switch (mr) {
    case 1: return Kernel<F, I, 1>(a, r0, wt, panel, y, ldy);
    case 2: return Kernel<F, I, 2>(a, r0, wt, panel, y, ldy);
    case 3: return Kernel<F, I, 3>(a, r0, wt, panel, y, ldy);
    case 4: return Kernel<F, I, 4>(a, r0, wt, panel, y, ldy);
    case 5: return Kernel<F, I, 5>(a, r0, wt, panel, y, ldy);
    case 6: return Kernel<F, I, 6>(a, r0, wt, panel, y, ldy);
    default: return;
  }
}
static_assert(kMR == 6, "Rows covers MR = 1..6");

template <Fmt F, Isa I>
void Run(ffi::ThreadPool& pool, const Acts& a, int64_t m, int64_t m_padded, int64_t panels, const Weight& w,
         const Weight* up, float* ys) {
  const int64_t n = panels * kPanel, chunks = (m + kRowChunk - 1) / kRowChunk;
  std::memset(ys + m * n, 0, (m_padded - m) * n * sizeof(float));
  jaxserve::ParallelFor(pool, panels * chunks, [&](int64_t i) {
    const int64_t panel = i % panels, c0 = (i / panels) * kRowChunk, rows = std::min<int64_t>(kRowChunk, m - c0);
    for (int64_t r = c0; r < c0 + rows; r += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, c0 + rows - r);
      float* y = ys + r * n + panel * kPanel;
      if (!up) {
        Rows<F, I>(mr, a, r, w, panel, y, n);
        continue;
      }
      alignas(64) float g[kMR * kPanel], u[kMR * kPanel];
      Rows<F, I>(mr, a, r, w, panel, g, kPanel);
      Rows<F, I>(mr, a, r, *up, panel, u, kPanel);
      for (int64_t j = 0; j < mr; ++j)
        for (int v = 0; v < kPanel; v += kW) {
          const v16 gv = Load<v16>(g + j * kPanel + v), uv = Load<v16>(u + j * kPanel + v);
          const v16 out = gv * uv / (1.0f + jaxserve::Exp(-gv));  // silu(g) * u
          std::memcpy(y + j * n + v, &out, sizeof(out));
        }
    }
  });
}

// The weight's panel count if (w, scale, colsum) is a well-formed weight of format f for x[., K].
int64_t Check(Fmt f, int64_t k_len, ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer colsum) {
  const auto wd = w.dimensions();
  const int64_t per = f == kBf16 ? 2 : 4;
  if (wd.size() != 3 || k_len % per != 0 || wd[1] != k_len / per || wd[2] != kPanel * per) return -1;
  if (f == kBf16) return w.element_type() == ffi::BF16 ? wd[0] : -1;
  const int64_t n = wd[0] * kPanel;
  return w.element_type() == ffi::S8 && scale.element_type() == ffi::F32 && scale.element_count() == n &&
                 colsum.element_type() == ffi::S32 && colsum.element_count() == n ? wd[0] : -1;
}

Weight Of(ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer colsum) {
  return {static_cast<const uint32_t*>(w.untyped_data()), static_cast<const float*>(scale.untyped_data()),
          static_cast<const int32_t*>(colsum.untyped_data())};
}

ffi::Error Call(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, const Weight& w, const Weight* up, int64_t panels,
                ffi::Buffer<ffi::S32> rows, float* y, int32_t fmt, int32_t isa) {
  const auto xd = x.dimensions();
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const Fmt f = Fmt(fmt);
  if (isa == kDot && !(f == kBf16 ? kHaveBf16 : kHaveVnni))
    return ffi::Error::InvalidArgument("dot matmul: isa=1 asked of a library built without the instructions");
  thread_local Acts acts;  // the caller's thread: the pool tasks are done with it when Run returns
  Prepare(f, x.typed_data(), m, xd[1], acts);
  if (f == kBf16 && isa == kDot) Run<kBf16, kDot>(pool, acts, m, xd[0], panels, w, up, y);
  if (f == kBf16 && isa != kDot) Run<kBf16, kPortable>(pool, acts, m, xd[0], panels, w, up, y);
  if (f == kW8A8 && isa == kDot) Run<kW8A8, kDot>(pool, acts, m, xd[0], panels, w, up, y);
  if (f == kW8A8 && isa != kDot) Run<kW8A8, kPortable>(pool, acts, m, xd[0], panels, w, up, y);
  return ffi::Error::Success();
}

bool Valid(ffi::Buffer<ffi::F32> x, int32_t fmt, int32_t isa, ffi::Buffer<ffi::S32> rows) {
  return x.dimensions().size() == 2 && (fmt == kBf16 || fmt == kW8A8) && (isa == kPortable || isa == kDot) &&
         rows.element_count() == 1;
}

ffi::Error DotMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                     ffi::AnyBuffer c, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t fmt,
                     int32_t isa) {
  const int64_t panels = Valid(x, fmt, isa, rows) ? Check(Fmt(fmt), x.dimensions()[1], w, s, c) : -1;
  if (panels < 0)
    return ffi::Error::InvalidArgument("dot matmul: expected x[M, K], a weight of format fmt (quant.py), rows[1]");
  const Weight wt = Of(w, s, c);
  return Call(pool, x, wt, nullptr, panels, rows, y->typed_data(), fmt, isa);
}

ffi::Error DotMatmulGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                          ffi::AnyBuffer cg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer cu,
                          ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t fmt, int32_t isa) {
  const int64_t panels = Valid(x, fmt, isa, rows) ? Check(Fmt(fmt), x.dimensions()[1], wg, sg, cg) : -1;
  if (panels < 0 || Check(Fmt(fmt), x.dimensions()[1], wu, su, cu) != panels)
    return ffi::Error::InvalidArgument("gated dot matmul: expected x[M, K], two weights of format fmt alike, rows[1]");
  const Weight g = Of(wg, sg, cg), u = Of(wu, su, cu);
  return Call(pool, x, g, &u, panels, rows, y->typed_data(), fmt, isa);
}

}  // namespace

// Which `isa = 1` paths this build has: bit 0 bf16 (AVX512_BF16), bit 1 w8a8 (AVX512_VNNI).
extern "C" int JaxserveDotIsa() { return (kHaveBf16 ? 1 : 0) | (kHaveVnni ? 2 : 0); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmul, DotMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::AnyBuffer>()         // scale (w8a8; else empty)
                                  .Arg<ffi::AnyBuffer>()         // colsum (w8a8; else empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]: real rows of x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("fmt")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmulGated, DotMatmulGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::AnyBuffer>()         // gate: w
                                  .Arg<ffi::AnyBuffer>()         // gate: scale
                                  .Arg<ffi::AnyBuffer>()         // gate: colsum
                                  .Arg<ffi::AnyBuffer>()         // up: w
                                  .Arg<ffi::AnyBuffer>()         // up: scale
                                  .Arg<ffi::AnyBuffer>()         // up: colsum
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("fmt")
                                  .Attr<int32_t>("isa"));
