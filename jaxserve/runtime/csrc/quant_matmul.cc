// The linear layers over quantized weights (runtime/quant.py), as XLA FFI custom calls:
//
//   jaxserve_quant_matmul:       y[M, N] = x[M, K] @ W
//   jaxserve_quant_matmul_gated: y[M, N] = silu(x @ W_gate) * (x @ W_up)
//   jaxserve_quant_matmul_grouped: the same over row groups, each times its own weight: a mixture-of-
//       experts layer's experts, stacked [E, ...] (each operand with a leading axis of E), rows sorted
//       by expert, sizes i32[E] rows per expert (runtime/expert_matmul.py); rows past the groups' are 0
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
// Why: decoding streams every weight once per step, so bytes per weight bound its speed. Each
// k-row of a panel (64 weights) is decoded in registers into four 16-lane float vectors right
// before the FMAs that use it, so memory traffic is that of the packed form, and the arithmetic
// is the float32 kernel's: y[i, j] sums x[i, k] * W[k, j] over k = 0..K-1 in order, whatever M is
// and however the work is split. Plain vector extensions: the compiler uses the widest the build
// targets (-march=native, per machine, see cpu_kernels.py), no instruction set is assumed here.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "formats.h"
#include "operand_shape.h"
#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kW;
using jaxserve::v16;
using jaxserve::Half;
using i8x16 = int8_t __attribute__((vector_size(16)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
using i32x16 = int32_t __attribute__((vector_size(64)));
// The formats' ids (Format: kINT8, kQ8_0, ...), kPanel, kBlock and kSuper (K-quants' super-block)
// come from formats.h, which runtime/native_build.py generates from runtime/weight_formats.py.
using namespace jaxserve::quant_matmul;
using jaxserve::kBlock;
using jaxserve::kPanel;
using jaxserve::kSuper;
constexpr int kNV = kPanel / kW, kMR = 6, kRowChunk = 48;
constexpr Format kDecoded = Format(kFormats);  // not a weight format: a panel already decoded

// One panel of a quantized weight: its quants and, for the block formats, per-block d and m.
struct Panel {
  const uint8_t* q;
  const _Float16* d;
  const _Float16* m;
  const float* f = nullptr;  // kDecoded
  const uint8_t* s = nullptr;  // K-quants: the sub-blocks' integer scales
};

template <typename V, typename T>
inline V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 small integers -> floats, through int32 (gcc scalarizes a direct int8 -> float conversion,
// and the signed widening too, where it can use an instruction for it).
template <typename V>
inline v16 Float(V q) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<V, i8x16>) {
    __m128i b;
    std::memcpy(&b, &q, sizeof(b));
    const __m512i i = _mm512_cvtepi8_epi32(b);
    i32x16 out;
    std::memcpy(&out, &i, sizeof(out));
    return __builtin_convertvector(out, v16);
  }
#endif
  return __builtin_convertvector(__builtin_convertvector(q, i32x16), v16);
}

// 16 float8_e4m3fn values (bits) -> floats, exactly: sign, 4 exponent bits (bias 7), 3 mantissa
// bits; exponent 0 is subnormal (m * 2^-9). NaN (0x7f, 0xff) is not decoded (no checkpoint has it).
inline v16 E4m3(u8x16 b) {
#ifdef __AVX512F__  // gcc scalarizes this widening here too
  __m128i raw;
  std::memcpy(&raw, &b, sizeof(raw));
  const __m512i wide = _mm512_cvtepu8_epi32(raw);
  i32x16 i;
  std::memcpy(&i, &wide, sizeof(i));
#else
  const i32x16 i = __builtin_convertvector(b, i32x16);
#endif
  const i32x16 e = (i >> 3) & 15, m = i & 7, sign = (i & 0x80) << 24;
  const i32x16 normal = sign | ((e + 120) << 23) | (m << 20);
  const v16 sub = __builtin_convertvector(m, v16) * (1.0f / 512);
  i32x16 sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub));
  const i32x16 bits = e == 0 ? (sub_bits | sign) : normal;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void Halves(const _Float16* p, v16 out[kNV]) {
  for (int v = 0; v < kNV; ++v) out[v] = Half(p + v * kW);
}

// MXFP4's e2m1 codes (sign bit 3, exponent bits 2..1, mantissa bit 0) -> their float32 values.
inline v16 E2m1(u8x16 c) {
  const i32x16 x = __builtin_convertvector(c, i32x16), e = (x >> 1) & 3, m = x & 1;
  const i32x16 normal = ((e + 126) << 23) | (m << 22), sub = m * (126 << 23);  // 1.m * 2^(e-1); 0 or 0.5
  const i32x16 is_normal = e != 0;
  const i32x16 bits = (normal & is_normal) | (sub & ~is_normal) | ((x & 8) << 28);
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// E8M0 exponents -> 2^(e - 127) in float32 (e = 0: the subnormal 2^-127).
inline v16 E8m0(u8x16 s) {
  const i32x16 e = __builtin_convertvector(s, i32x16);
  const i32x16 bits = (e << 23) | ((e == 0) & 0x00400000);
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Weights per block that shares one (d, m) pair of vectors in ForEachRow.
template <Format F>
constexpr int kSub = F == kQ6_K ? 16 : kBlock;

// Block b's scale (and offset: Q4's m, Q4_K's -dmin * min) vectors, d[kNV] and m[kNV].
template <Format F>
inline void BlockScales(const Panel& p, int64_t b, v16 d[kNV], v16 m[kNV]) {
  if constexpr (F == kQ4_K) {
    const int64_t sup = b / (kSuper / kBlock);
    for (int v = 0; v < kNV; ++v) {
      d[v] = Half(p.d + (2 * sup) * kPanel + v * kW) * Float(Load<u8x16>(p.s + (2 * b) * kPanel + v * kW));
      m[v] = -(Half(p.d + (2 * sup + 1) * kPanel + v * kW) * Float(Load<u8x16>(p.s + (2 * b + 1) * kPanel + v * kW)));
    }
  } else if constexpr (F == kQ6_K) {
    for (int v = 0; v < kNV; ++v)
      d[v] = Half(p.d + b / (kSuper / 16) * kPanel + v * kW) * Float(Load<i8x16>(p.s + b * kPanel + v * kW));
  } else if constexpr (F == kMXFP4) {
    for (int v = 0; v < kNV; ++v) d[v] = E8m0(Load<u8x16>(p.s + b * kPanel + v * kW));
  } else {
    Halves(p.d + b * kPanel, d);
    if constexpr (F == kQ4_1) Halves(p.m + b * kPanel, m);
  }
}

// Q6_K rows k and k + 1 (k even) of 16 columns at v: the 6-bit values - 32, as int8.
inline void Q6Pair(const uint8_t* q, int64_t k, int v, i8x16& lo, i8x16& hi) {
  const uint8_t* sb = q + k / kSuper * (192 * kPanel);
  const int64_t kk = k % kSuper;
  const u8x16 nib = Load<u8x16>(sb + kk / 2 * kPanel + v * kW);
  const u8x16 top = Load<u8x16>(sb + (128 + kk / 4) * kPanel + v * kW) >> (2 * (kk % 4));
  lo = (i8x16)((nib & 15) | (top & 3) << 4) - 32;
  hi = (i8x16)((nib >> 4) | (top & 12) << 2) - 32;
}

using jaxserve::Opaque;  // (vec.h) a decoded weight's scale is not folded into the FMAs

// Calls use(k, w) for k = 0..K-1 in order, w[kNV] the panel's row k decoded (int8: q, unscaled),
// and fence() between the two rows a Q4 byte holds.
template <Format F, typename Use, typename Fence>
inline void ForEachRow(const Panel& p, int64_t k_len, Use&& use, Fence&& fence) {
  v16 w[kNV], hi[kNV], d[kNV], m[kNV];
  if constexpr (F == kDecoded) {
    for (int64_t k = 0; k < k_len; ++k) {
      for (int v = 0; v < kNV; ++v) w[v] = Load<v16>(p.f + k * kPanel + v * kW);
      use(k, w);
    }
  } else if constexpr (F == kINT8 || F == kFP8) {
    for (int64_t k = 0; k < k_len; ++k) {
      for (int v = 0; v < kNV; ++v) {
        if constexpr (F == kINT8)
          w[v] = Float(Load<i8x16>(p.q + k * kPanel + v * kW));
        else
          w[v] = E4m3(Load<u8x16>(p.q + k * kPanel + v * kW));
        Opaque(w[v]);
      }
      use(k, w);
    }
  } else {
    constexpr bool kPairs = F != kQ8_0;  // two rows per byte (Q4, Q4_K) or per step (Q6_K)
    for (int64_t b = 0; b < k_len / kSub<F>; ++b) {
      BlockScales<F>(p, b, d, m);
      for (int64_t k = b * kSub<F>; k < (b + 1) * kSub<F>; k += kPairs ? 2 : 1) {
        for (int v = 0; v < kNV; ++v) {
          if constexpr (F == kQ4_1 || F == kQ4_K) {
            const u8x16 byte = Load<u8x16>(p.q + k / 2 * kPanel + v * kW);
            w[v] = Float(byte & 15) * d[v] + m[v];
            hi[v] = Float(byte >> 4) * d[v] + m[v];
            Opaque(hi[v]);
          } else if constexpr (F == kMXFP4) {
            const u8x16 byte = Load<u8x16>(p.q + k / 2 * kPanel + v * kW);
            w[v] = E2m1(byte & 15) * d[v];
            hi[v] = E2m1(byte >> 4) * d[v];
            Opaque(hi[v]);
          } else if constexpr (F == kQ6_K) {
            i8x16 lo, up;
            Q6Pair(p.q, k, v, lo, up);
            w[v] = Float(lo) * d[v];
            hi[v] = Float(up) * d[v];
            Opaque(hi[v]);
          } else {
            w[v] = Float(Load<i8x16>(p.q + k * kPanel + v * kW)) * d[v];
          }
          Opaque(w[v]);
        }
        use(k, w);
        if constexpr (kPairs) {
          fence();
          use(k + 1, hi);
        }
      }
    }
  }
}

// out[K, 64] = the panel decoded (int8: q, unscaled): what the row tiles of a chunk share.
template <Format F>
void Decode(const Panel& p, int64_t k_len, float* out) {
  ForEachRow<F>(p, k_len, [&](int64_t k, const v16* w) { std::memcpy(out + k * kPanel, w, kNV * sizeof(v16)); },
                [] {});
}

// y[0:MR, 0:64] = x[0:MR, :] @ panel, times `scale` per column where given (int8); x rows K apart,
// y rows ldy apart.
template <Format F, int MR>
void Kernel(const float* x, const Panel& p, const float* scale, float* y, int64_t k_len, int64_t ldy) {
  v16 c[MR][kNV] = {};
  ForEachRow<F>(p, k_len, [&](int64_t k, const v16* w) {
    for (int r = 0; r < MR; ++r) {
      const float a = x[r * k_len + k];
      for (int v = 0; v < kNV; ++v) c[r][v] += a * w[v];
    }
  }, [&] {  // k's products summed before k + 1's, not the two added together first
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kNV; ++v) Opaque(c[r][v]);
  });
  if (scale)
    for (int v = 0; v < kNV; ++v) {
      const v16 s = Load<v16>(scale + v * kW);
      for (int r = 0; r < MR; ++r) c[r][v] *= s;
    }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) std::memcpy(y + r * ldy + v * kW, &c[r][v], sizeof(v16));
}

template <Format F>
void Tile(int64_t mr, const float* x, const Panel& p, const float* scale, float* y, int64_t k_len, int64_t ldy) {
  switch (mr) {
    case 1: return Kernel<F, 1>(x, p, scale, y, k_len, ldy);
    case 2: return Kernel<F, 2>(x, p, scale, y, k_len, ldy);
    case 3: return Kernel<F, 3>(x, p, scale, y, k_len, ldy);
    case 4: return Kernel<F, 4>(x, p, scale, y, k_len, ldy);
    case 5: return Kernel<F, 5>(x, p, scale, y, k_len, ldy);
    case 6: return Kernel<F, 6>(x, p, scale, y, k_len, ldy);
    default: return;
  }
}
static_assert(kMR == 6, "Tile covers MR = 1..6");

// A quantized weight as the kernel reads it: base pointers and per-panel strides.
struct Weight {
  const uint8_t* q;
  const void* d;  // int8: f32 scale[N]; else f16[P, K / 32, 64]
  const _Float16* m;
  Panel At(int64_t panel, int64_t k_len, Format f) const {
    if (f == kINT8 || f == kFP8) return {q + panel * k_len * kPanel, nullptr, nullptr};
    if (f == kMXFP4) {  // the exponents (bytes) in s
      Panel p{q + panel * k_len / 2 * kPanel, nullptr, nullptr};
      p.s = static_cast<const uint8_t*>(d) + panel * k_len / kBlock * kPanel;
      return p;
    }
    if (f == kQ4_K || f == kQ6_K) {  // m holds the sub-blocks' integer scales
      const int64_t qs = (f == kQ4_K ? k_len / 2 : k_len / kSuper * 192) * kPanel;
      const int64_t ds = k_len / kSuper * (f == kQ4_K ? 2 : 1) * kPanel;
      const int64_t ss = f == kQ4_K ? k_len / kBlock * 2 * kPanel : k_len / 16 * kPanel;
      Panel p{q + panel * qs, static_cast<const _Float16*>(d) + panel * ds, nullptr};
      p.s = reinterpret_cast<const uint8_t*>(m) + panel * ss;
      return p;
    }
    const int64_t qs = f == kQ4_1 ? k_len / 2 * kPanel : k_len * kPanel, ds = k_len / kBlock * kPanel;
    return {q + panel * qs, static_cast<const _Float16*>(d) + panel * ds, m ? m + panel * ds : nullptr};
  }
  const float* Scale(int64_t panel, Format f) const {
    return f == kINT8 || f == kFP8 ? static_cast<const float*>(d) + panel * kPanel : nullptr;
  }
};

// ys = xs @ W, or silu(xs @ W) * (xs @ W_up) where `ups`, over `chunks`' row groups: group g's rows
// times ws[g] (and ups[g]); the rows after the groups' (to m_padded) come out zero.
template <Format F>
void Run(ffi::ThreadPool& pool, const float* xs, const jaxserve::RowChunks& chunks, int64_t m_padded, int64_t k_len,
         int64_t panels, const Weight* ws, const Weight* ups, float* ys) {
  const int64_t n = panels * kPanel, m = chunks.rows();
  std::memset(ys + m * n, 0, (m_padded - m) * n * sizeof(float));
  jaxserve::ParallelFor(pool, panels * chunks.size(), [&](int64_t i) {
    int64_t group, r0, rows;
    chunks.At(i / panels, group, r0, rows);
    const int64_t panel = i % panels;
    const Weight& w = ws[group];
    const Weight* w_up = ups ? ups + group : nullptr;
    const Panel pg = w.At(panel, k_len, F), pu = w_up ? w_up->At(panel, k_len, F) : Panel{};
    const float *sg = w.Scale(panel, F), *su = w_up ? w_up->Scale(panel, F) : nullptr;
    // A chunk of more than one row tile decodes the panel once, into this thread's buffer, and runs
    // the kernel over the floats: the same values, summed in the same order, decoded 1 / 8 as often.
    thread_local std::vector<float> buf_g, buf_u;
    const bool shared = rows > kMR;
    if (shared) {
      buf_g.resize(k_len * kPanel);
      Decode<F>(pg, k_len, buf_g.data());
      if (w_up) {
        buf_u.resize(k_len * kPanel);
        Decode<F>(pu, k_len, buf_u.data());
      }
    }
    auto tile = [&](int64_t mr, const float* x, bool up, float* y, int64_t ldy) {
      if (!shared) return Tile<F>(mr, x, up ? pu : pg, up ? su : sg, y, k_len, ldy);
      Panel decoded{};
      decoded.f = (up ? buf_u : buf_g).data();
      Tile<kDecoded>(mr, x, decoded, up ? su : sg, y, k_len, ldy);
    };
    for (int64_t r = r0; r < r0 + rows; r += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, r0 + rows - r);
      const float* x = xs + r * k_len;
      float* y = ys + r * n + panel * kPanel;
      if (!w_up) {
        tile(mr, x, false, y, n);
        continue;
      }
      alignas(64) float g[kMR * kPanel], u[kMR * kPanel];
      tile(mr, x, false, g, kPanel);
      tile(mr, x, true, u, kPanel);
      for (int64_t j = 0; j < mr; ++j)
        for (int v = 0; v < kPanel; v += kW) {
          const v16 gv = Load<v16>(g + j * kPanel + v), uv = Load<v16>(u + j * kPanel + v);
          const v16 out = gv * uv / (1.0f + jaxserve::Exp(-gv));  // silu(g) * u
          std::memcpy(y + j * n + v, &out, sizeof(out));
        }
    }
  });
}

using jaxserve::Shape;  // operand_shape.h

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

// Expert e's part of operand a: a's bytes from e * (its size / experts) (experts 1: a itself).
const void* Part(ffi::AnyBuffer a, int64_t experts, int64_t e) {
  return static_cast<const uint8_t*>(a.untyped_data()) + a.size_bytes() / experts * e;
}

Weight Of(ffi::AnyBuffer q, ffi::AnyBuffer d, ffi::AnyBuffer m, Format f, int64_t experts = 1, int64_t e = 0) {
  return {static_cast<const uint8_t*>(Part(q, experts, e)), Part(d, experts, e),
          f == kQ4_1 || f == kQ4_K || f == kQ6_K ? static_cast<const _Float16*>(Part(m, experts, e)) : nullptr};
}

ffi::Error Dispatch(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, int32_t format, const jaxserve::RowChunks& chunks,
                    const Weight* ws, const Weight* ups, int64_t panels, float* y) {
  const auto xd = x.dimensions();
  switch (format) {
    case kINT8: Run<kINT8>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
    case kQ8_0: Run<kQ8_0>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
    case kQ4_1: Run<kQ4_1>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
    case kFP8: Run<kFP8>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
    case kQ4_K: Run<kQ4_K>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
    case kQ6_K: Run<kQ6_K>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
    case kMXFP4: Run<kMXFP4>(pool, x.typed_data(), chunks, xd[0], xd[1], panels, ws, ups, y); break;
  }
  return ffi::Error::Success();
}

// One group of a call's first `rows` rows (clamped to x's).
jaxserve::RowChunks OneGroup(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rows) {
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, x.dimensions()[0]);
  return jaxserve::RowChunks(&m, 1, kRowChunk);
}

bool Valid(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rows) {
  return x.dimensions().size() == 2 && rows.element_count() == 1;
}

// A `format` that is not one of formats.h's ids (the caller and the library disagree on the table).
ffi::Error UnknownFormat(const char* call, int32_t format) {
  return ffi::Error::InvalidArgument(std::string(call) + ": unknown weight format id " + std::to_string(format) +
                                     " (formats.h, from runtime/weight_formats.py, has 0.." +
                                     std::to_string(kFormats - 1) + ")");
}

ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer d,
                       ffi::AnyBuffer m, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t format) {
  if (!Known(format)) return UnknownFormat("quant matmul", format);
  const int64_t panels = Valid(x, rows) ? Check(Format(format), x.dimensions()[1], q, d, m) : -1;
  if (panels < 0)
    return ffi::Error::InvalidArgument("quant matmul: expected x[M, K], a weight of its format (quant.py), rows[1]");
  const Weight w = Of(q, d, m, Format(format));
  return Dispatch(pool, x, format, OneGroup(x, rows), &w, nullptr, panels, y->typed_data());
}

ffi::Error QuantMatmulGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qg, ffi::AnyBuffer dg,
                            ffi::AnyBuffer mg, ffi::AnyBuffer qu, ffi::AnyBuffer du, ffi::AnyBuffer mu,
                            ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t format) {
  if (!Known(format)) return UnknownFormat("gated quant matmul", format);
  const int64_t panels = Valid(x, rows) ? Check(Format(format), x.dimensions()[1], qg, dg, mg) : -1;
  if (panels < 0 || Check(Format(format), x.dimensions()[1], qu, du, mu) != panels)
    return ffi::Error::InvalidArgument("gated quant matmul: expected x[M, K], two weights of its format alike, rows[1]");
  const Weight g = Of(qg, dg, mg, Format(format)), u = Of(qu, du, mu, Format(format));
  return Dispatch(pool, x, format, OneGroup(x, rows), &g, &u, panels, y->typed_data());
}

// Stacked experts (every operand [E, ...], q's leading axis E) of format f for x[., K]: the panels of
// one expert's weight, else -1.
int64_t CheckStacked(Format f, int64_t k_len, int64_t experts, ffi::AnyBuffer q, ffi::AnyBuffer d, ffi::AnyBuffer m) {
  for (ffi::AnyBuffer a : {q, d, m})
    if (a.element_count() && (a.dimensions().size() == 0 || a.dimensions()[0] != experts)) return -1;
  return Check(f, k_len, Shape(q, 1), Shape(d, 1), Shape(m, 1));
}

// Row groups of sizes[E] (negative ones as 0; all of them within x's rows).
jaxserve::RowChunks Groups(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> sizes, int64_t chunk) {
  std::vector<int64_t> rows(sizes.element_count());
  int64_t left = x.dimensions()[0];
  for (size_t e = 0; e < rows.size(); ++e) left -= rows[e] = std::clamp<int64_t>(sizes.typed_data()[e], 0, left);
  return jaxserve::RowChunks(rows.data(), int64_t(rows.size()), chunk);
}

// Gated where the up operands are given (qu not empty).
ffi::Error QuantMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qg, ffi::AnyBuffer dg,
                              ffi::AnyBuffer mg, ffi::AnyBuffer qu, ffi::AnyBuffer du, ffi::AnyBuffer mu,
                              ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y, int32_t format) {
  if (!Known(format)) return UnknownFormat("grouped quant matmul", format);
  const Format f = Format(format);
  const int64_t experts = sizes.element_count(), gated = qu.element_count() > 0;
  const int64_t panels = x.dimensions().size() == 2 && experts > 0
                             ? CheckStacked(f, x.dimensions()[1], experts, qg, dg, mg) : -1;
  if (panels < 0 || (gated && CheckStacked(f, x.dimensions()[1], experts, qu, du, mu) != panels))
    return ffi::Error::InvalidArgument("grouped quant matmul: expected x[M, K], stacked weights [E, ...] of its "
                                       "format (runtime/expert_matmul.py), sizes i32[E]");
  std::vector<Weight> ws, ups;
  for (int64_t e = 0; e < experts; ++e) {
    ws.push_back(Of(qg, dg, mg, f, experts, e));
    if (gated) ups.push_back(Of(qu, du, mu, f, experts, e));
  }
  return Dispatch(pool, x, format, Groups(x, sizes, kRowChunk), ws.data(), gated ? ups.data() : nullptr, panels,
                  y->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmul, QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // scale (int8) or d
                                  .Arg<ffi::AnyBuffer>()         // m (Q4; else empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]: real rows of x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("format"));  // formats.h's quant_matmul::Format

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulGated, QuantMatmulGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::AnyBuffer>()         // gate: q
                                  .Arg<ffi::AnyBuffer>()         // gate: scale or d
                                  .Arg<ffi::AnyBuffer>()         // gate: m
                                  .Arg<ffi::AnyBuffer>()         // up: q
                                  .Arg<ffi::AnyBuffer>()         // up: scale or d
                                  .Arg<ffi::AnyBuffer>()         // up: m
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulGrouped, QuantMatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K], rows sorted by expert
                                  .Arg<ffi::AnyBuffer>()         // gate (or the one weight): q [E, ...]
                                  .Arg<ffi::AnyBuffer>()         // gate: scale or d [E, ...]
                                  .Arg<ffi::AnyBuffer>()         // gate: m [E, ...] (or empty)
                                  .Arg<ffi::AnyBuffer>()         // up: q [E, ...], empty: not gated
                                  .Arg<ffi::AnyBuffer>()         // up: scale or d
                                  .Arg<ffi::AnyBuffer>()         // up: m
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sizes[E]: rows per expert
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("format"));

// The weight formats' table this library was built with (formats.h): the loader checks it against
// runtime/weight_formats.py's (native_build.format_table).
extern "C" const char* JaxserveFormats() { return jaxserve::kFormatTable; }
