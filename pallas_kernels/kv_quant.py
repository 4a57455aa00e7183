"""Quantized KV pages: int8 / fp8 data with one float32 scale per (token, kv head).

A quantized cache is a `QuantPages` where a float cache is an array: every KV write and every
attention path dispatches on the pages' type (no flag through the model). The data keeps the
layout's shape ([nb, bs, Hkv, D], whatever the layout's order inside a block); the scales have
that shape minus the head_dim axis ([nb, bs, Hkv]; tpu-fused [nb, 2 * Hkv, bs, Dp] data has
[nb, 2 * Hkv, bs] scales, ``tpu.fused_scale_shape``). Scaling is symmetric absmax per (token, head):
int8 q = round(x / s) with s = absmax / 127; fp8 q = fp8(x / s) with s = absmax / finfo.max
(448 for e4m3, 57344 for e5m2); x ~= q * s.

Kernels that can, apply the scales to scores instead of to K/V: score[c] = (q . k_q[c]) * s_k[c]
and out = sum_c (p[c] * s_v[c]) v_q[c], so a tile is widened (int8/fp8 -> float, exact) but never
multiplied element by element. `dequantize` is the plain form every path is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# --kv-cache-dtype name -> storage dtype of the data
KV_QUANT_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
                   "fp8_e5m2": jnp.dtype(jnp.float8_e5m2)}


class QuantPages(NamedTuple):
    """One layer's K (or V) pages, quantized: data int8/fp8 [nb, bs, Hkv, D], scale f32 [nb, bs, Hkv]."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def is_quantized(name: str | None) -> bool:
    """Whether a --kv-cache-dtype name is one of the quantized ones."""
    return name in KV_QUANT_DTYPES


def qmax(dtype) -> float:
    """The largest magnitude a quantized value takes (the scale maps absmax onto it)."""
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x[..., D] -> (data[..., D] of `dtype`, scale f32[...]): symmetric absmax per row."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    top = qmax(dtype)
    # absmax times the float32 reciprocal (not a division by a constant, which XLA may rewrite into
    # that product or not): the native CPU write computes exactly this, bit for bit.
    scale = jnp.max(jnp.abs(x), axis=-1) * np.float32(1.0 / top)
    q = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -top, top)
    q = jnp.round(q).astype(dtype) if dtype == jnp.int8 else q.astype(dtype)
    return q, scale


def dequantize(pages: QuantPages) -> jax.Array:
    """The float32 values quantized pages stand for (data * scale)."""
    return pages.data.astype(jnp.float32) * pages.scale[..., None]


def gather(pages, index) -> jax.Array:
    """`pages[index]` as float32 (dequantized for QuantPages): the page load of the jnp paths."""
    if isinstance(pages, QuantPages):
        return pages.data[index].astype(jnp.float32) * pages.scale[index][..., None]
    return pages[index].astype(jnp.float32)


def empty(shape: tuple[int, ...], name_or_dtype) -> jax.Array | QuantPages:
    """Zeroed pages of `shape` [nb, bs, Hkv, D]: a float array, or QuantPages for a quantized
    --kv-cache-dtype name."""
    if is_quantized(name_or_dtype):
        return QuantPages(jnp.zeros(shape, KV_QUANT_DTYPES[name_or_dtype]), jnp.zeros(shape[:-1], jnp.float32))
    return jnp.zeros(shape, name_or_dtype)


def scatter_rows(pages, x: jax.Array, slot_mapping: jax.Array):
    """x[T, Hkv, D] into flat slots of pages [nb, bs, Hkv, D] (one XLA scatter per array),
    quantized first when the pages are QuantPages."""
    if isinstance(pages, QuantPages):
        data, scale = quantize(x, pages.data.dtype)
        return QuantPages(scatter_rows(pages.data, data, slot_mapping),
                          scatter_rows(pages.scale, scale, slot_mapping))
    nb, bs = pages.shape[:2]
    flat = pages.reshape(nb * bs, *pages.shape[2:]).at[slot_mapping].set(x.astype(pages.dtype))
    return flat.reshape(pages.shape)
