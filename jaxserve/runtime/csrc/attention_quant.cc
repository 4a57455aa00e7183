// Ragged paged attention's kernels (csrc/attention_tiles.h) for int8 and fp8 (e4m3fn / e5m2)
// pages, their scales applied to the tiles' scores and probabilities.

#include <cstdint>

#include "attention.h"
#include "attention_tiles.h"
#include "page_types.h"

namespace jaxserve::attention {

template ItemFn PickItemFn<int8_t>(int64_t bs, int64_t d);
template ItemFn PickItemFn<E4m3>(int64_t bs, int64_t d);
template ItemFn PickItemFn<E5m2>(int64_t bs, int64_t d);

}  // namespace jaxserve::attention
