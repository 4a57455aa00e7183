// Linear layers on the CPU's dot-product instructions, as XLA FFI custom calls:
//
//   jaxserve_dot_matmul:       y[M, N] = x[M, K] @ W
//   jaxserve_dot_matmul_gated: y[M, N] = silu(x @ W_gate) * (x @ W_up)
//   jaxserve_dot_matmul_grouped: the same over row groups, each times its own weight: a mixture-of-
//       experts layer's experts, stacked [E, ...] (each operand with a leading axis of E), rows sorted
//       by expert, sizes i32[E] rows per expert (runtime/expert_matmul.py); rows past the groups' are 0
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "formats.h"
#include "mxfp4a8.h"
#include "operand_shape.h"
#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::Half;
using jaxserve::kW;
using jaxserve::v16;
using i32x16 = int32_t __attribute__((vector_size(64)));
// The formats' ids (Format: kBFLOAT16, kW8A8, ...), kPanel and kBlock come from formats.h, which
// runtime/native_build.py generates from runtime/weight_formats.py.
using namespace jaxserve::dot_matmul;
using jaxserve::kBlock;
using jaxserve::kPanel;
constexpr int kNV = kPanel / kW, kMR = 6, kRowChunk = 48;
constexpr int kQuads = kBlock / 4;  // w8a8's activation blocks (kBlock k values) in 4-k words
constexpr bool Blocked(int f) { return f == kW4A8 || f == kQ8A8; }  // d and m per block of 32 k
constexpr bool Nibbled(int f) { return f == kW4A8 || f == kMXFP4A8; }  // two quads a byte (w4a8's layout)
// Rows per tile: 6 x 4 accumulator vectors (of AVX-512's 32 registers; w4a8's nibbles take 8
// more); the int8 formats' float32 block sums live in memory (L1), updated once per block.
template <int F>
constexpr int kMaxMR = Nibbled(F) ? 4 : 6;
enum Isa { kPortable = 0, kDot = 1, kAmx = 2 };

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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define JAXSERVE_AMX 1
constexpr bool kHaveAmx = true;
#else
constexpr bool kHaveAmx = false;
#endif
constexpr int kAmxRows = 16;  // rows of an AMX tile: the activations' row step on isa 2
constexpr int kAmxChunk = 64;  // rows per work item on isa 2
constexpr int kAmxMinRowsW8A8 = 16;  // W8A8: a partial tile runs isa 1 (no faster on AMX: bench quant_matmul)

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

using jaxserve::Opaque;  // (vec.h) two products are not added together before the sum

// float32 -> bfloat16 bits, round to nearest even (ml_dtypes' and XLA's convert; no NaN inputs).
inline uint32_t Bf16(float f) {
  const uint32_t u = Bits<uint32_t>(f);
  return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

// w4a8: a word of nibbles as its low quad and its high quad of bytes 0..15.
inline void Nibbles(i32x16 b, i32x16& lo, i32x16& hi) {
  lo = b & 0x0f0f0f0f;
  hi = (b >> 4) & 0x0f0f0f0f;
}

// Where panel `panel` of weight words `w` starts: K / per rows of 64 words (w4a8: a row holds 8 k).
template <Format F>
inline const uint32_t* PanelWords(const uint32_t* w, int64_t panel, int64_t k_words) {
  return w + panel * (Nibbled(F) ? k_words / 2 : k_words) * kPanel;
}

// One step of a tile: the 64 columns' accumulators of MR rows. Each k step (a pair for bf16, a
// quad for w8a8) reads 4 vectors of the panel and one 32-bit word of each row's activations.
template <Format F, Isa I, int MR>
struct Tile {
  using Acc = std::conditional_t<F == kBFLOAT16, v16, i32x16>;
  Acc c[MR][kNV] = {};

  // k steps s0..s1 (w4a8: steps of two quads, one row of nibbles, the low ones first).
  void Run(const uint32_t* x, const uint32_t* w, int64_t s0, int64_t s1, int64_t ldx) {
    for (int64_t s = s0; s < s1; ++s) {
      i32x16 b[kNV];
      for (int v = 0; v < kNV; ++v) b[v] = Load<i32x16>(w + s * kPanel + v * kW);
      if constexpr (Nibbled(F)) {
        i32x16 hi[kNV];
        for (int v = 0; v < kNV; ++v) Nibbles(b[v], b[v], hi[v]);
        if constexpr (F == kMXFP4A8)
          for (int v = 0; v < kNV; ++v) b[v] = jaxserve::mxfp4a8::Lookup(b[v]), hi[v] = jaxserve::mxfp4a8::Lookup(hi[v]);
        for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + 2 * s], b);
        for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + 2 * s + 1], hi);
      } else {
        for (int r = 0; r < MR; ++r) Step(r, x[r * ldx + s], b);
      }
    }
  }

  inline void Step(int r, uint32_t a, const i32x16* b) {
    if constexpr (F == kBFLOAT16 && I == kDot && kHaveBf16) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a));
      for (int v = 0; v < kNV; ++v)
        c[r][v] = Bits<v16>(_mm512_dpbf16_ps(Bits<__m512>(c[r][v]), av, Bits<__m512bh>(b[v])));
    } else if constexpr (F == kBFLOAT16) {  // vdpbf16ps' order: the odd k of the pair, then the even one
      const float lo = Bits<float>(a << 16), hi = Bits<float>(a & 0xffff0000u);
      for (int v = 0; v < kNV; ++v) {
        c[r][v] += hi * Bits<v16>(b[v] & int32_t(0xffff0000u));
        Opaque(c[r][v]);
        c[r][v] += lo * Bits<v16>(b[v] << 16);
        Opaque(c[r][v]);
      }
    } else if constexpr (I == kDot && kHaveVnni) {  // unsigned weights (q + 128, or q4) times signed x
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a));
      for (int v = 0; v < kNV; ++v)
        c[r][v] = Bits<i32x16>(_mm512_dpbusd_epi32(Bits<__m512i>(c[r][v]), Bits<__m512i>(b[v]), av));
    } else {  // exact integers: any order gives the same sum
      for (int t = 0; t < 4; ++t) {
        const int32_t xt = int32_t(a << (24 - 8 * t)) >> 24;
        for (int v = 0; v < kNV; ++v) c[r][v] += xt * ((b[v] >> (8 * t)) & 255);
      }
    }
  }
};

// A call's activations, prepared once for all its rows: bf16 pairs, or w8a8 quads of xq (int8)
// with each block's scale sx and sum of xq.
struct Acts {
  std::vector<uint32_t> words;
  std::vector<float> sx;
  std::vector<int32_t> xsum;
  int64_t ldx = 0, blocks = 0;  // words and w8a8 blocks per row
};

// Row r of x into a's words (and w8a8's block scales and sums).
void PrepareRow(Format f, const float* xr, int64_t k_len, Acts& a, int64_t r) {
  uint32_t* out = a.words.data() + r * a.ldx;
  if (f == kBFLOAT16) {
    for (int64_t i = 0; i < a.ldx; ++i) out[i] = Bf16(xr[2 * i]) | Bf16(xr[2 * i + 1]) << 16;
    return;
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* xb = xr + b * kBlock;
    float amax = 0;
    for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int8_t q[kBlock];
    int32_t sum = 0;
    for (int k = 0; k < kBlock; ++k) {
      q[k] = int8_t(std::clamp(std::nearbyint(xb[k] * inv), -127.0f, 127.0f));
      sum += q[k];
    }
    std::memcpy(out + b * kQuads, q, sizeof(q));  // word i, byte t = x[4 i + t] (little-endian)
    a.sx[r * a.blocks + b] = amax / 127.0f;
    a.xsum[r * a.blocks + b] = sum;
  }
}

// All m rows, a few rows per work item (prefill's thousands of rows are worth the threads).
void Prepare(ffi::ThreadPool& pool, Format f, const float* x, int64_t m, int64_t k_len, Acts& a) {
  constexpr int64_t kRows = 16;
  a.ldx = k_len / (f == kBFLOAT16 ? 2 : 4);
  a.blocks = f == kBFLOAT16 ? 0 : k_len / kBlock;
  a.words.resize(m * a.ldx);
  a.sx.resize(m * a.blocks);
  a.xsum.resize(m * a.blocks);
  jaxserve::ParallelFor(pool, (m + kRows - 1) / kRows, [&](int64_t i) {
    for (int64_t r = i * kRows; r < std::min(m, (i + 1) * kRows); ++r) PrepareRow(f, x + r * k_len, k_len, a, r);
  });
}

// A weight as the kernel reads it (w8a8: with its scales; w4a8: its blocks' d and m; mxfp4a8: its
// blocks' exponents).
struct Weight {
  const uint32_t* w;
  const float* scale;
  const _Float16* d = nullptr;
  const _Float16* m = nullptr;
  const uint8_t* e = nullptr;
};

// mxfp4a8: a block's scales 2^(e - 128) for a panel's 64 columns.
struct MxScales {
  v16 s[kNV];
  MxScales() = default;
  MxScales(const Weight& wt, int64_t panel, int64_t blocks, int64_t b) {
    for (int v = 0; v < kNV; ++v) s[v] = jaxserve::mxfp4a8::Scales(wt.e + (panel * blocks + b) * kPanel + v * kW);
  }
};

// w4a8, q8a8: a block's d and m for a panel's 64 columns (f16 -> float32, once per block, not per row).
struct W4Scales {
  v16 d[kNV], m[kNV];
  W4Scales() = default;
  W4Scales(const Weight& wt, int64_t panel, int64_t blocks, int64_t b) {
    for (int v = 0; v < kNV; ++v)
      d[v] = Half(wt.d + (panel * blocks + b) * kPanel + v * kW), m[v] = Half(wt.m + (panel * blocks + b) * kPanel + v * kW);
  }
};

// w4a8, q8a8: one block's sum into a row's float32 sum, f + sx (d sum(xq q) + m sum(xq)), for 16 columns.
inline v16 W4Block(v16 f, i32x16 sum, float sx, int32_t xsum, v16 d, v16 m) {
  v16 t = d * __builtin_convertvector(sum, v16) + m * float(xsum);
  Opaque(t);
  v16 out = f + t * sx;
  Opaque(out);  // block by block, in k order, on every path
  return out;
}

// w4a8: the words of a panel's nibble rows (K / 8 of them) as w8a8's quad rows (K / 4) of bytes
// 0..15, what an AMX tile loads (it reads bytes, not nibbles); into `out`, K * 16 words. mxfp4a8:
// each byte through its table (2 e2m1 + 12).
template <Format F>
void SplitNibbles(const uint32_t* w, int64_t rows, uint32_t* out) {
  for (int64_t g = 0; g < rows; ++g)
    for (int v = 0; v < kNV; ++v) {
      i32x16 lo, hi;
      Nibbles(Load<i32x16>(w + g * kPanel + v * kW), lo, hi);
      if constexpr (F == kMXFP4A8) lo = jaxserve::mxfp4a8::Lookup(lo), hi = jaxserve::mxfp4a8::Lookup(hi);
      std::memcpy(out + 2 * g * kPanel + v * kW, &lo, sizeof(lo));
      std::memcpy(out + (2 * g + 1) * kPanel + v * kW, &hi, sizeof(hi));
    }
}

// y[0:MR, 0:64] for one panel. bf16: the tile's float32 sums. w8a8: per block of 32 k, the exact
// int32 sum of (q + 128) xq from -128 sum xq, times the block's sx, added to a float32 sum in
// block order; then times scale[n].
template <Format F, Isa I, int MR>
void Kernel(const Acts& a, int64_t r0, const Weight& wt, int64_t panel, float* y, int64_t ldy) {
  const uint32_t* x = a.words.data() + r0 * a.ldx;
  const uint32_t* w = PanelWords<F>(wt.w, panel, a.ldx);
  Tile<F, I, MR> t;
  alignas(64) float f[MR][kPanel] = {};
  if constexpr (F == kBFLOAT16) {
    t.Run(x, w, 0, a.ldx, a.ldx);
  } else if constexpr (F == kMXFP4A8) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < kNV; ++v)
          t.c[r][v] = i32x16{} - jaxserve::mxfp4a8::kOffset * a.xsum[(r0 + r) * a.blocks + b];
      t.Run(x, w, b * (kQuads / 2), (b + 1) * (kQuads / 2), a.ldx);
      const MxScales sc(wt, panel, a.blocks, b);
      for (int r = 0; r < MR; ++r) {
        const float sx = a.sx[(r0 + r) * a.blocks + b];
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = jaxserve::mxfp4a8::Block(Load<v16>(f[r] + v * kW), t.c[r][v], sc.s[v], sx);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
      }
      asm("" ::: "memory");
    }
  } else if constexpr (Blocked(F)) {
    constexpr int steps = F == kW4A8 ? kQuads / 2 : kQuads;  // k steps per block (w4a8: of two quads)
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < kNV; ++v) t.c[r][v] = i32x16{};
      t.Run(x, w, b * steps, (b + 1) * steps, a.ldx);
      const W4Scales dm(wt, panel, a.blocks, b);
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (r0 + r) * a.blocks + b;
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = W4Block(Load<v16>(f[r] + v * kW), t.c[r][v], a.sx[at], a.xsum[at], dm.d[v], dm.m[v]);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
      }
      asm("" ::: "memory");
    }
  } else {
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < kNV; ++v) t.c[r][v] = i32x16{} - 128 * a.xsum[(r0 + r) * a.blocks + b];
      t.Run(x, w, b * kQuads, (b + 1) * kQuads, a.ldx);
      for (int r = 0; r < MR; ++r) {
        const float sx = a.sx[(r0 + r) * a.blocks + b];
        for (int v = 0; v < kNV; ++v) {
          v16 fv = Load<v16>(f[r] + v * kW) + __builtin_convertvector(t.c[r][v], v16) * sx;
          Opaque(fv);  // block by block, in k order, for every MR
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
      }
      asm("" ::: "memory");  // keep f in memory: its 24 vectors would not fit in registers beside t.c
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) {
      v16 out;
      if constexpr (F == kBFLOAT16)
        out = t.c[r][v];
      else if constexpr (Blocked(F) || F == kMXFP4A8)
        out = Load<v16>(f[r] + v * kW);
      else
        out = Load<v16>(f[r] + v * kW) * Load<v16>(wt.scale + panel * kPanel + v * kW);
      std::memcpy(y + r * ldy + v * kW, &out, sizeof(out));
    }
}


#ifdef JAXSERVE_AMX
// The tile shapes of one call (ldtilecfg's 64-byte operand, palette 1): tmm0-3 the 4 x 16
// float32 / int32 columns of a panel for `mr` rows, tmm4 the rows' activations (16 bf16 pairs or
// one W8A8 block: 8 quads), tmm5-7 the weights' tiles (16 k steps of 16 columns, 256 bytes apart).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <Format F>
void ConfigureTiles(int mr) {
  TileConfig cfg;
  const int steps = F == kBFLOAT16 ? 16 : kQuads;  // k words per tile: 32 bf16 k, or one 32-k block
  for (int t = 0; t < 4; ++t) cfg.rows[t] = mr, cfg.colsb[t] = 64;
  cfg.rows[4] = mr, cfg.colsb[4] = steps * 4;
  for (int t = 5; t < 8; ++t) cfg.rows[t] = steps, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// The accumulators tmm0-3 (a panel's 4 x 16 columns) to zero, and to memory (row stride in bytes).
inline void ZeroTiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

template <typename T>
inline void StoreTiles(T* dst, int64_t stride) {
  _tile_stored(0, dst, stride);
  _tile_stored(1, dst + 16, stride);
  _tile_stored(2, dst + 32, stride);
  _tile_stored(3, dst + 48, stride);
}

// One k step into tmm0-3: the rows' activations (tmm4, from x) times the panel's four 16-column
// weight tiles (tmm5-7 in turn, from w: 64 bytes apart, rows ldw apart). The tile macros take
// register numbers as tokens (no template constants), hence the instruction as a macro argument.
#define JAXSERVE_TILE_STEP(DOT)    \
  _tile_loadd(4, x, ldx);          \
  _tile_loadd(5, w, ldw);          \
  _tile_loadd(6, w + 64, ldw);     \
  DOT(0, 4, 5);                    \
  _tile_loadd(7, w + 128, ldw);    \
  DOT(1, 4, 6);                    \
  _tile_loadd(5, w + 192, ldw);    \
  DOT(2, 4, 7);                    \
  DOT(3, 4, 5)

template <Format F>
inline void TileStep(const char* x, int64_t ldx, const char* w, int64_t ldw) {
  if constexpr (F == kBFLOAT16) {
    JAXSERVE_TILE_STEP(_tile_dpbf16ps);
  } else {
    JAXSERVE_TILE_STEP(_tile_dpbsud);
  }
}
#undef JAXSERVE_TILE_STEP

// y[0:mr, 0:64] for one panel, mr <= 16, on AMX tiles (ConfigureTiles<F>(mr) loaded), reading the
// panel's words at wp (w4a8: SplitNibbles' bytes). bf16: float32 sums over k in steps of 32. W8A8:
// per block of 32 k the exact int32 sum of xq (q + 128) (tdpbsud: signed activations, unsigned
// weights), less 128 sum xq, then as Kernel<kW8A8>; w4a8: the sum of xq q, then as Kernel<kW4A8>;
// mxfp4a8: the sum of xq (2 e2m1 + 12) less 12 sum xq, then as Kernel<kMXFP4A8>.
template <Format F>
void AmxKernel(const Acts& a, int64_t r0, int mr, const Weight& wt, const uint32_t* wp, int64_t panel, float* y,
               int64_t ldy) {
  const char* x = reinterpret_cast<const char*>(a.words.data() + r0 * a.ldx);
  const char* w = reinterpret_cast<const char*>(wp);
  const int64_t ldx = a.ldx * 4, ldw = kPanel * 4;
  ZeroTiles();
  if constexpr (F == kBFLOAT16) {
    for (int64_t s = 0; s < a.ldx; s += 16) TileStep<F>(x + s * 4, ldx, w + s * ldw, ldw);
    StoreTiles(y, ldy * 4);
    return;
  }
  alignas(64) int32_t c[kAmxRows][kPanel];
  alignas(64) float f[kAmxRows][kPanel] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    TileStep<F>(x + b * kBlock, ldx, w + b * kQuads * ldw, ldw);
    StoreTiles(c[0], sizeof(c[0]));
    ZeroTiles();
    const W4Scales dm = Blocked(F) ? W4Scales(wt, panel, a.blocks, b) : W4Scales{};
    const MxScales sc = F == kMXFP4A8 ? MxScales(wt, panel, a.blocks, b) : MxScales{};
    for (int r = 0; r < mr; ++r) {
      const float sx = a.sx[(r0 + r) * a.blocks + b];
      if constexpr (F == kMXFP4A8) {
        const i32x16 corr = i32x16{} - jaxserve::mxfp4a8::kOffset * a.xsum[(r0 + r) * a.blocks + b];
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = jaxserve::mxfp4a8::Block(Load<v16>(f[r] + v * kW), Load<i32x16>(c[r] + v * kW) + corr,
                                                  sc.s[v], sx);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
        continue;
      }
      if constexpr (Blocked(F)) {
        for (int v = 0; v < kNV; ++v) {
          const v16 fv = W4Block(Load<v16>(f[r] + v * kW), Load<i32x16>(c[r] + v * kW), sx,
                                 a.xsum[(r0 + r) * a.blocks + b], dm.d[v], dm.m[v]);
          std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
        }
        continue;
      }
      const i32x16 corr = i32x16{} - 128 * a.xsum[(r0 + r) * a.blocks + b];
      for (int v = 0; v < kNV; ++v) {
        const i32x16 sum = Load<i32x16>(c[r] + v * kW) + corr;
        v16 fv = Load<v16>(f[r] + v * kW) + __builtin_convertvector(sum, v16) * sx;
        Opaque(fv);  // as Kernel<kW8A8>: block by block, in k order
        std::memcpy(f[r] + v * kW, &fv, sizeof(fv));
      }
    }
  }
  for (int r = 0; r < mr; ++r)
    for (int v = 0; v < kNV; ++v) {
      v16 out = Load<v16>(f[r] + v * kW);
      if constexpr (!Blocked(F) && F != kMXFP4A8) out *= Load<v16>(wt.scale + panel * kPanel + v * kW);
      std::memcpy(y + r * ldy + v * kW, &out, sizeof(out));
    }
}
#endif

// Kernel<MR> for any 0 < MR <= kMaxMR<F>.
template <Format F, Isa I, int MR = 1>
void Rows(int64_t mr, const Acts& a, int64_t r0, const Weight& wt, int64_t panel, float* y, int64_t ldy) {
  if constexpr (MR <= kMaxMR<F>) {
    if (mr == MR) return Kernel<F, I, MR>(a, r0, wt, panel, y, ldy);
    Rows<F, I, MR + 1>(mr, a, r0, wt, panel, y, ldy);
  }
}
static_assert(kMaxMR<kBFLOAT16> <= kAmxRows && kMaxMR<kW8A8> <= kAmxRows && kMaxMR<kW4A8> <= kAmxRows &&
                  kMaxMR<kQ8A8> <= kAmxRows && kMaxMR<kMXFP4A8> <= kAmxRows,
              "the gated buffers hold 16 rows");

// ys = x @ W, or silu(x @ W) * (x @ W_up) where `ups`, over row groups (group g: the next
// group_rows[g] rows, times ws[g] and ups[g]); the rows after the groups' (to m_padded) come out zero.
template <Format F, Isa I>
void Run(ffi::ThreadPool& pool, const Acts& a, const std::vector<int64_t>& group_rows, int64_t m_padded,
         int64_t panels, const Weight* ws, const Weight* ups, float* ys) {
  // Rows per work item: AMX reads a panel's weights once per 16 rows, from L2 after the first.
  constexpr int64_t chunk = I == kAmx ? kAmxChunk : kRowChunk, step = I == kAmx ? kAmxRows : kMaxMR<F>;
  static_assert(kAmxChunk % kAmxRows == 0, "AMX row tiles do not straddle chunks");
  const jaxserve::RowChunks chunks(group_rows.data(), int64_t(group_rows.size()), chunk);
  const int64_t n = panels * kPanel, m = chunks.rows();
  std::memset(ys + m * n, 0, (m_padded - m) * n * sizeof(float));
  jaxserve::ParallelFor(pool, panels * chunks.size(), [&](int64_t i) {
    int64_t group, c0, rows;
    chunks.At(i / panels, group, c0, rows);
    const int64_t panel = i % panels;
    const Weight& w = ws[group];
    const Weight* up = ups ? ups + group : nullptr;
    int configured = 0;  // the rows the tiles are configured for (AMX)
    // w4a8 on AMX: the panel's nibbles split into bytes once per work item (gate, then up)
    thread_local std::vector<uint32_t> split[2];
    const uint32_t* panel_words[2] = {PanelWords<F>(w.w, panel, a.ldx), up ? PanelWords<F>(up->w, panel, a.ldx) : nullptr};
    if constexpr (I == kAmx && Nibbled(F))
      if (rows >= kAmxMinRowsW8A8)
        for (int i = 0; i < (up ? 2 : 1); ++i) {
          split[i].resize(a.ldx * kPanel);
          SplitNibbles<F>(panel_words[i], a.ldx / 2, split[i].data());
          panel_words[i] = split[i].data();
        }
    const auto rows_of = [&](int64_t mr, int64_t r, const Weight& wt, float* y, int64_t ldy) {
#ifdef JAXSERVE_AMX
      // The int8 formats' block sums are exact: a few rows run isa 1's kernel (faster there, the
      // same bits).
      if constexpr (I == kAmx && F != kBFLOAT16)
        if (mr < kAmxMinRowsW8A8) {
          for (int64_t j = 0; j < mr; j += kMaxMR<F>)
            Rows<F, kDot>(std::min<int64_t>(kMaxMR<F>, mr - j), a, r + j, wt, panel, y + j * ldy, ldy);
          return;
        }
      if constexpr (I == kAmx) {
        if (configured != mr) ConfigureTiles<F>(configured = int(mr));
        return AmxKernel<F>(a, r, int(mr), wt, panel_words[&wt == up], panel, y, ldy);
      }
#endif
      if constexpr (I != kAmx) Rows<F, I>(mr, a, r, wt, panel, y, ldy);
    };
    for (int64_t r = c0; r < c0 + rows; r += step) {
      const int64_t mr = std::min<int64_t>(step, c0 + rows - r);
      float* y = ys + r * n + panel * kPanel;
      if (!up) {
        rows_of(mr, r, w, y, n);
        continue;
      }
      alignas(64) float g[kAmxRows * kPanel], u[kAmxRows * kPanel];
      rows_of(mr, r, w, g, kPanel);
      rows_of(mr, r, *up, u, kPanel);
      for (int64_t j = 0; j < mr; ++j)
        for (int v = 0; v < kPanel; v += kW) {
          const v16 gv = Load<v16>(g + j * kPanel + v), uv = Load<v16>(u + j * kPanel + v);
          const v16 out = gv * uv / (1.0f + jaxserve::Exp(-gv));  // silu(g) * u
          std::memcpy(y + j * n + v, &out, sizeof(out));
        }
    }
#ifdef JAXSERVE_AMX
    if (configured) _tile_release();  // the thread's tile state back to init (cheap context switches)
#endif
  });
}

using jaxserve::Shape;  // operand_shape.h

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

// Expert e's part of operand a: a's bytes from e * (its size / experts) (experts 1: a itself).
const void* Part(ffi::AnyBuffer a, int64_t experts, int64_t e) {
  return static_cast<const uint8_t*>(a.untyped_data()) + a.size_bytes() / experts * e;
}

Weight Of(ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer mins, int64_t experts = 1, int64_t e = 0) {
  const void* s = Part(scale, experts, e);
  return {static_cast<const uint32_t*>(Part(w, experts, e)), static_cast<const float*>(s),
          static_cast<const _Float16*>(s), static_cast<const _Float16*>(Part(mins, experts, e)),
          static_cast<const uint8_t*>(s)};
}

// x's rows as groups (group_rows: rows per group, in order; one group: a plain matmul) times ws (and ups).
ffi::Error Call(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, const Weight* ws, const Weight* ups, int64_t panels,
                const std::vector<int64_t>& group_rows, float* y, int32_t format, int32_t isa) {
  const auto xd = x.dimensions();
  int64_t m = 0;
  for (int64_t r : group_rows) m += r;
  const Format f = Format(format);
  if ((isa == kDot && !(f == kBFLOAT16 ? kHaveBf16 : kHaveVnni)) || (isa == kAmx && !kHaveAmx))
    return ffi::Error::InvalidArgument("dot matmul: an isa asked of a library built without its instructions");
  if (isa == kAmx && xd[1] % 32 != 0) isa = kDot;  // a tile takes 32 k at a time (per shape, not batch)
  thread_local Acts acts;  // the caller's thread: the pool tasks are done with it when Run returns
  Prepare(pool, f, x.typed_data(), m, xd[1], acts);
#ifdef JAXSERVE_AMX
  if (f == kBFLOAT16 && isa == kAmx) Run<kBFLOAT16, kAmx>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kW8A8 && isa == kAmx) Run<kW8A8, kAmx>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kW4A8 && isa == kAmx) Run<kW4A8, kAmx>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kQ8A8 && isa == kAmx) Run<kQ8A8, kAmx>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kMXFP4A8 && isa == kAmx) Run<kMXFP4A8, kAmx>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
#endif
  if (f == kBFLOAT16 && isa == kDot) Run<kBFLOAT16, kDot>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kBFLOAT16 && isa == kPortable) Run<kBFLOAT16, kPortable>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kW8A8 && isa == kDot) Run<kW8A8, kDot>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kW8A8 && isa == kPortable) Run<kW8A8, kPortable>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kW4A8 && isa == kDot) Run<kW4A8, kDot>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kW4A8 && isa == kPortable) Run<kW4A8, kPortable>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kQ8A8 && isa == kDot) Run<kQ8A8, kDot>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kQ8A8 && isa == kPortable) Run<kQ8A8, kPortable>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kMXFP4A8 && isa == kDot) Run<kMXFP4A8, kDot>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  if (f == kMXFP4A8 && isa == kPortable) Run<kMXFP4A8, kPortable>(pool, acts, group_rows, xd[0], panels, ws, ups, y);
  return ffi::Error::Success();
}

bool Valid(ffi::Buffer<ffi::F32> x, int32_t isa, ffi::Buffer<ffi::S32> rows) {
  return x.dimensions().size() == 2 && (isa == kPortable || isa == kDot || isa == kAmx) && rows.element_count() == 1;
}

// One group: a call's first `rows` rows (clamped to x's).
std::vector<int64_t> OneGroup(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rows) {
  return {std::clamp<int64_t>(rows.typed_data()[0], 0, x.dimensions()[0])};
}

// A `format` that is not one of formats.h's ids (the caller and the library disagree on the table).
ffi::Error UnknownFormat(const char* call, int32_t format) {
  return ffi::Error::InvalidArgument(std::string(call) + ": unknown weight format id " + std::to_string(format) +
                                     " (formats.h, from runtime/weight_formats.py, has 0.." +
                                     std::to_string(kFormats - 1) + ")");
}

ffi::Error DotMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                     ffi::AnyBuffer mn, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t format,
                     int32_t isa) {
  if (!Known(format)) return UnknownFormat("dot matmul", format);
  const int64_t panels = Valid(x, isa, rows) ? Check(Format(format), x.dimensions()[1], w, s, mn) : -1;
  if (panels < 0)
    return ffi::Error::InvalidArgument("dot matmul: expected x[M, K], a weight of its format (quant.py), rows[1]");
  const Weight wt = Of(w, s, mn);
  return Call(pool, x, &wt, nullptr, panels, OneGroup(x, rows), y->typed_data(), format, isa);
}

ffi::Error DotMatmulGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                          ffi::AnyBuffer mg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer mu,
                          ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t format, int32_t isa) {
  if (!Known(format)) return UnknownFormat("gated dot matmul", format);
  const int64_t panels = Valid(x, isa, rows) ? Check(Format(format), x.dimensions()[1], wg, sg, mg) : -1;
  if (panels < 0 || Check(Format(format), x.dimensions()[1], wu, su, mu) != panels)
    return ffi::Error::InvalidArgument("gated dot matmul: expected x[M, K], two weights of its format alike, rows[1]");
  const Weight g = Of(wg, sg, mg), u = Of(wu, su, mu);
  return Call(pool, x, &g, &u, panels, OneGroup(x, rows), y->typed_data(), format, isa);
}

// Gated where the up operands are given (wu not empty); as csrc/quant_matmul.cc's grouped call.
ffi::Error DotMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wg, ffi::AnyBuffer sg,
                            ffi::AnyBuffer mg, ffi::AnyBuffer wu, ffi::AnyBuffer su, ffi::AnyBuffer mu,
                            ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y, int32_t format, int32_t isa) {
  if (!Known(format)) return UnknownFormat("grouped dot matmul", format);
  const int64_t experts = sizes.element_count(), gated = wu.element_count() > 0;
  const auto stacked = [&](ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::AnyBuffer m) -> int64_t {
    for (ffi::AnyBuffer a : {w, s, m})
      if (a.element_count() && (a.dimensions().size() == 0 || a.dimensions()[0] != experts)) return -1;
    return Check(Format(format), x.dimensions()[1], Shape(w, 1), Shape(s, 1), Shape(m, 1));
  };
  const bool valid = x.dimensions().size() == 2 && (isa == kPortable || isa == kDot || isa == kAmx) && experts > 0;
  const int64_t panels = valid ? stacked(wg, sg, mg) : -1;
  if (panels < 0 || (gated && stacked(wu, su, mu) != panels))
    return ffi::Error::InvalidArgument("grouped dot matmul: expected x[M, K], stacked weights [E, ...] of its "
                                       "format (runtime/expert_matmul.py), sizes i32[E]");
  std::vector<Weight> ws, ups;
  std::vector<int64_t> rows(experts);
  int64_t left = x.dimensions()[0];
  for (int64_t e = 0; e < experts; ++e) {
    left -= rows[e] = std::clamp<int64_t>(sizes.typed_data()[e], 0, left);
    ws.push_back(Of(wg, sg, mg, experts, e));
    if (gated) ups.push_back(Of(wu, su, mu, experts, e));
  }
  return Call(pool, x, ws.data(), gated ? ups.data() : nullptr, panels, rows, y->typed_data(), format, isa);
}

}  // namespace

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmul, DotMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::AnyBuffer>()         // scale (w8a8), d (w4a8); else empty
                                  .Arg<ffi::AnyBuffer>()         // m (w4a8; else empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]: real rows of x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmulGated, DotMatmulGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K]
                                  .Arg<ffi::AnyBuffer>()         // gate: w
                                  .Arg<ffi::AnyBuffer>()         // gate: scale / d
                                  .Arg<ffi::AnyBuffer>()         // gate: m
                                  .Arg<ffi::AnyBuffer>()         // up: w
                                  .Arg<ffi::AnyBuffer>()         // up: scale / d
                                  .Arg<ffi::AnyBuffer>()         // up: m
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows[1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDotMatmulGrouped, DotMatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x[M, K], rows sorted by expert
                                  .Arg<ffi::AnyBuffer>()         // gate (or the one weight): w [E, ...]
                                  .Arg<ffi::AnyBuffer>()         // gate: scale / d [E, ...]
                                  .Arg<ffi::AnyBuffer>()         // gate: m [E, ...] (or empty)
                                  .Arg<ffi::AnyBuffer>()         // up: w [E, ...], empty: not gated
                                  .Arg<ffi::AnyBuffer>()         // up: scale / d
                                  .Arg<ffi::AnyBuffer>()         // up: m
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sizes[E]: rows per expert
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y[M, N]
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("isa"));
