// An FFI operand's element type and dimensions, shared by the quantized and dot-product matmuls'
// shape checks; a stacked operand's (`lead` 1: experts) without its leading axis.
#pragma once

#include <algorithm>
#include <cstdint>
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

}  // namespace jaxserve
