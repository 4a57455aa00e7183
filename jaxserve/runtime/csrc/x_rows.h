// A matmul's activation rows as its kernels read them (csrc/dot_acts.h's preparation, csrc/quant_kernel.h's
// tiles): row r of x[M, K], or, under a row order (a mixture-of-experts layer's grouped call,
// csrc/format_matmul.h), row order[r] / k of the tokens x[T, K], k = M / T: the expert-sorted rows
// read where the tokens lie, with no gathered [M, K] copy (csrc/moe_rows.cc's gather, for the
// products that take none). `order` is checked to be a Permutation before any row is read.
#pragma once

#include <cstdint>
#include <vector>

namespace jaxserve {

struct XRows {
  const float* x;
  int64_t k_len;                   // floats per row
  const int32_t* order = nullptr;  // null: the rows as given
  int64_t per = 1;                 // rows per token under an order (k)
  const float* operator()(int64_t r) const { return x + (order ? order[r] / per : r) * k_len; }
};

// Whether order is M distinct values in [0, M) (a permutation).
inline bool Permutation(const int32_t* order, int64_t m) {
  std::vector<bool> seen(m);
  for (int64_t r = 0; r < m; ++r) {
    if (order[r] < 0 || order[r] >= m || seen[order[r]]) return false;
    seen[order[r]] = true;
  }
  return true;
}

}  // namespace jaxserve
