"""The structured-output token mask inside the compiled sampler: packed bits -> -inf logits.

A constrained row's allowed tokens arrive as i32[ceil(V/32)] words (bit j of word i allows token
32*i + j; the layout llguidance fills on the host). The width is fixed by V, so every batch has
the same shape and nothing recompiles; an unconstrained row is all ones (-1), which keeps every
logit. Apply it before temperature, truncation and sampling, so the draw and EOS both obey it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.structured.matcher import bitmask_width


def full_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """i32[S, W] that allows everything (the rows without a grammar)."""
    return np.full((num_rows, bitmask_width(vocab_size)), -1, np.int32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits f32[S, V], bitmask i32[S, ceil(V/32)] -> f32[S, V], disallowed tokens at -inf."""
    s, v = logits.shape
    assert bitmask.shape == (s, bitmask_width(v)), (bitmask.shape, logits.shape)
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # i32[S, W, 32]
    allowed = bits.reshape(s, -1)[:, :v].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_token_bitmask_ref(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """numpy reference: the same contract, bit by bit."""
    v = logits.shape[1]
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    return np.where(bits[:, :v].astype(bool), logits, -np.inf).astype(logits.dtype)
