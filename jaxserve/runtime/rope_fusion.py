"""RoPE as the attention call takes it: a layer's cos / sin tables go with q and k to
`ModelOps.attention(..., rope=Rope(cos, sin))`, and the backend rotates them where it reads them.

The native CPU backend's KV write rotates each key row as it stores it and its attention each query
vector as it loads it (csrc/rope.h), on the core whose matmul share computed the row: a prefill
layer is then its native calls alone, with no XLA op (split over XLA's threads its own way, so rows
crossed between the cores) between the q/k/v projections and attention. Every other backend
rotates q and k here, as the XLA ops the model ran before; both compute the same float32 values
(two rounded products and their sum).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def apply_rope(x, cos, sin):
    """HF's rotate-half convention, [x1 c - x2 s, x2 c + x1 s], as x * cos + [x2, x1] * sin over the
    full width (XLA:CPU runs this form ~4x faster than concatenating the two halves' results).
    x: [T, H, D]; cos/sin: [T, R] from `model.layers.rope_tables`; R < D (partial rotary): only the
    first R dims rotate, the rest pass through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = x * cos[:, None, :] + jnp.concatenate([x2, x1], axis=-1) * sin[:, None, :]
    return out.astype(x.dtype)


class Rope(NamedTuple):
    """A layer's RoPE for this step's tokens: cos and signed sin, f32[T, R] each."""

    cos: jax.Array
    sin: jax.Array

    def __call__(self, x):
        return apply_rope(x, self.cos, self.sin)


def native_operands(rope: Rope | None) -> tuple[jax.Array, jax.Array]:
    """The native calls' RoPE operands: the tables in float32, or f32[0] both for none."""
    if rope is None:
        none = jnp.zeros((0,), jnp.float32)
        return none, none
    return rope.cos.astype(jnp.float32), rope.sin.astype(jnp.float32)
