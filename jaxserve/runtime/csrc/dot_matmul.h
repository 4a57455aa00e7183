// The dot-product matmul (csrc/dot_matmul.cc: its formats, instructions and FFI calls): the paths'
// constants, and a call's activations (prepared by csrc/dot_acts.h) and weights as the kernels
// (csrc/dot_tile.h, csrc/dot_amx.h, csrc/dot_run.h) read them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "formats.h"
#include "vec.h"

// The formats' ids (Format: kBFLOAT16, kW8A8, ...), kPanel and kBlock come from formats.h, which
// runtime/native_build.py generates from runtime/weight_formats.py.
namespace jaxserve::dot_matmul {

constexpr int kNV = kPanel / kW, kRowChunk = 48;
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
constexpr int kAmxChunk = 64;  // rows per work item on isa 2 (the int8 formats; bf16: csrc/dot_amx_run.h)
constexpr int kAmxMinRowsW8A8 = 16;  // W8A8: a partial tile runs isa 1 (no faster on AMX: bench quant_matmul)

// A vector's allocator on 64-byte (cache line) boundaries. An AMX tile row is 64 bytes: from a
// buffer malloc leaves 16-byte aligned each one spans two lines, which made the tile loads (and the
// bf16 kernel) about half as fast (bench quant_matmul; tile rows are K * 2 or 256 bytes apart).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// A call's activations, prepared once for all its rows: bf16 pairs, or w8a8 quads of xq (int8)
// with each block's scale sx and sum of xq.
struct Acts {
  AlignedVector<uint32_t> words;  // tile rows start on cache lines (K a multiple of 32)
  std::vector<float> sx;
  std::vector<int32_t> xsum;
  int64_t ldx = 0, blocks = 0;  // words and w8a8 blocks per row
};

// A weight as the kernel reads it (w8a8: with its scales; w4a8: its blocks' d and m; mxfp4a8: its
// blocks' exponents).
struct Weight {
  const uint32_t* w;
  const float* scale;
  const _Float16* d = nullptr;
  const _Float16* m = nullptr;
  const uint8_t* e = nullptr;
};

}  // namespace jaxserve::dot_matmul
