// An FFI operand's element type and dimensions, shared by the quantized and dot-product matmuls'
// shape checks; a stacked operand's (`lead` 1: experts) without its leading axis, and each
// expert's part of it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

struct Shape {
  xla::ffi::DataType type;
  std::vector<int64_t> dims;
  Shape(xla::ffi::AnyBuffer a, size_t lead = 0) : type(a.element_type()) {
    const auto d = a.dimensions();
    dims.assign(d.begin() + std::min(lead, d.size()), d.end());
  }
  int64_t count() const {
    int64_t c = 1;
    for (int64_t d : dims) c *= d;
    return c;
  }
};

// Whether the operands are a stack of `experts` (each empty, or [experts, ...]).
inline bool Stacked(std::initializer_list<xla::ffi::AnyBuffer> operands, int64_t experts) {
  for (xla::ffi::AnyBuffer a : operands)
    if (a.element_count() && (a.dimensions().size() == 0 || a.dimensions()[0] != experts)) return false;
  return true;
}

// Expert e's part of operand a: a's bytes from e * (its size / experts) (experts 1: a itself).
inline const void* Part(xla::ffi::AnyBuffer a, int64_t experts, int64_t e) {
  return static_cast<const uint8_t*>(a.untyped_data()) + a.size_bytes() / experts * e;
}

}  // namespace jaxserve
