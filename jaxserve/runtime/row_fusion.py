"""The decoder's row operations a linear layer's call can take in: the RMS norm of its input rows and
the residual added to its output (`ModelOps.linear(x, w, num_rows, norm=, residual=)`, `gated(...,
norm=)`).

The native dot-product matmul (csrc/dot_matmul.cc, format_matmul.h's RowFusion) norms each row as
it prepares it and adds the residual to each output tile as it writes it, on the core that computed
the row: with RoPE inside the KV write and attention (runtime/rope_fusion.py), a prefill layer is
then its native calls alone, with no XLA elementwise pass (each split over XLA's threads its own
way, so rows crossed between the cores) between them. Every other op
applies them here, as the XLA ops the model ran before (model/layers.py's RMSNorm is `RowNorm`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scale"], meta_fields=["eps"])
@dataclass(frozen=True)
class RowNorm:
    """x * rsqrt(mean(x^2) + eps) * scale over each row's last axis, in float32, back in x's dtype
    (scale: f32[K], the norm's weight; Gemma's 1 + weight). A pytree whose eps is static (the
    native call's attribute)."""

    scale: jax.Array
    eps: float

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.scale).astype(x.dtype)


def unfused(op: Callable) -> Callable:
    """`op(x, *weights_and_rows)` as an op that also takes `norm` (applied to x first) and
    `residual` (added to its output, in the residual's dtype) as XLA ops."""

    @functools.wraps(op)
    def call(x, *args, norm: RowNorm | None = None, residual=None):
        y = op(x if norm is None else norm(x), *args)
        return y if residual is None else y.astype(residual.dtype) + residual

    return call
