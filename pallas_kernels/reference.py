"""Pure-jnp oracles for the paged-attention kernels (same signatures as the kernels).

Written for obviousness, not speed: every query row is scored against every slot its sequence's
block table can address, and a mask keeps the causal / sliding-window / own-sequence entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import gather, scatter_rows

MASK_VALUE = -1e30


def token_layout(
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per q row: (sequence id, absolute position, is-real-token) — i32[T], i32[T], bool[T]."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, seq_lens.shape[0] - 1)
    valid = (t < query_start_loc[num_seqs[0]]) & (t >= query_start_loc[seq])
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + (t - query_start_loc[seq])
    return seq, pos, valid


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1]
    block_tables: jax.Array,  # i32[S, max_blocks_per_seq]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq] learned per-head logits in the softmax denominator
    interpret: bool = False,
    **unused_block_sizes,
) -> jax.Array:  # [T, Hq, D], padding rows zero
    """``sinks`` (gpt-oss): each head's softmax runs over its scores plus one extra logit that
    takes probability mass and contributes no value."""
    del interpret, unused_block_sizes
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    ctx = max_blocks * block_size

    seq, pos, valid = token_layout(seq_lens, query_start_loc, num_seqs, num_tokens)
    # Pages as float32 (quantized pages dequantized: kv_quant.QuantPages).
    k = gather(k_pages, block_tables).reshape(-1, ctx, num_kv_heads, head_dim)  # [S, ctx, Hkv, D]
    v = gather(v_pages, block_tables).reshape(-1, ctx, num_kv_heads, head_dim)
    k = jnp.repeat(k[seq], group, axis=2)  # [T, ctx, Hq, D]
    v = jnp.repeat(v[seq], group, axis=2)

    s = jnp.einsum("thd,tchd->thc", q.astype(jnp.float32), k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    kv_pos = jnp.arange(ctx, dtype=jnp.int32)[None, :]
    mask = (kv_pos <= pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= kv_pos > pos[:, None] - sliding_window
    s = jnp.where(mask[:, None, :], s, MASK_VALUE)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (num_tokens, num_q_heads, 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    # Slots past the context (block-table padding -> null block) may hold anything, even NaN.
    v = jnp.where((kv_pos < seq_lens[seq][:, None])[:, :, None, None], v, 0.0)
    out = jnp.einsum("thc,tchd->thd", p, v)
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def write_kv(
    k_pages,  # [num_blocks, block_size, Hkv, D] (or kv_quant.QuantPages)
    v_pages,
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]; slot = block_id * block_size + offset
    *,
    interpret: bool = False,
):
    """New K/V rows into their slots (rounded to the pages' dtype, or quantized)."""
    del interpret
    return scatter_rows(k_pages, k, slot_mapping), scatter_rows(v_pages, v, slot_mapping)
