"""The ``tpu-fused`` KV layout of the Mosaic TPU kernels (see ``tpu``): one array per layer,
``[num_blocks, 2 * Hkv, block_size, Dp]``, row 2h of a page kv head h's K and 2h + 1 its V, the
head dim padded to 128 lanes; quantized pages' scales ``[num_blocks, 2 * Hkv, block_size]``.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.kv_quant import QuantPages

LANES = 128


def sublanes(dtype) -> int:
    """Rows of this dtype in one TPU sublane tile: 8 of 32-bit, 16 of 16-bit, 32 of 8-bit."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def fused_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> tuple:
    """The ``tpu-fused`` array of one layer: [num_blocks, 2 * Hkv, block_size, head_dim to 128]."""
    if block_size % sublanes(dtype):
        raise ValueError(f"block_size {block_size} is not a multiple of {sublanes(dtype)}, the "
                         f"TPU's sublane packing of {jnp.dtype(dtype).name}")
    return num_blocks, 2 * num_kv_heads, block_size, common.round_up(head_dim, LANES)


def fused_scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple:
    """The scales of quantized ``tpu-fused`` pages: f32 [num_blocks, 2 * Hkv, block_size] (the
    data's shape minus its lanes; row 2h K's, 2h + 1 V's, one lane per token)."""
    return num_blocks, 2 * num_kv_heads, block_size


def scale_page_bytes(block_size: int, num_kv_heads: int) -> int:
    """HBM bytes of one page's scales as allocated: XLA tiles the minor (2 * Hkv, block_size) f32
    dims by (8, 128), so they pad to that (``runner.kv_bytes_per_block`` counts this)."""
    return common.round_up(2 * num_kv_heads, 8) * common.round_up(block_size, LANES) * 4


def fuse_pages(k_pages, v_pages):
    """Separate [nb, bs, Hkv, D] K and V pages -> the fused layout (tests, the generic API);
    QuantPages -> QuantPages of the fused data and the [nb, 2 * Hkv, bs] scales."""
    if isinstance(k_pages, QuantPages):
        nb, bs, hkv = k_pages.scale.shape
        scale = jnp.stack([k_pages.scale, v_pages.scale], axis=3).transpose(0, 2, 3, 1)
        return QuantPages(fuse_pages(k_pages.data, v_pages.data), scale.reshape(nb, 2 * hkv, bs))
    nb, bs, hkv, d = k_pages.shape
    kv = jnp.stack([k_pages, v_pages], axis=3).transpose(0, 2, 3, 1, 4)  # [nb, Hkv, 2, bs, D]
    kv = kv.reshape(nb, 2 * hkv, bs, d)
    return jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, fused_shape(nb, bs, hkv, d, kv.dtype)[3] - d)))


def unfuse_pages(kv, head_dim: int) -> tuple:
    """The inverse of ``fuse_pages`` (tests)."""
    if isinstance(kv, QuantPages):
        nb, h2, bs = kv.scale.shape
        scale = kv.scale.reshape(nb, h2 // 2, 2, bs).transpose(2, 0, 3, 1)
        k, v = unfuse_pages(kv.data, head_dim)
        return QuantPages(k, scale[0]), QuantPages(v, scale[1])
    nb, h2, bs, _ = kv.shape
    kv = kv[..., :head_dim].reshape(nb, h2 // 2, 2, bs, head_dim).transpose(2, 0, 3, 1, 4)
    return kv[0], kv[1]
