// Ragged paged attention's kernels (csrc/attention_tiles.h) for float32 and bfloat16 pages.

#include <cstdint>

#include "attention.h"
#include "attention_tiles.h"
#include "page_types.h"

namespace jaxserve::attention {

template ItemFn PickItemFn<float>(int64_t bs, int64_t d);
template ItemFn PickItemFn<Bf16>(int64_t bs, int64_t d);

}  // namespace jaxserve::attention
