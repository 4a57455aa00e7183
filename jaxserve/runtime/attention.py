"""Attention backends: write new K/V into the paged cache, then ragged paged attention.

Every backend has the same signature as `pallas_kernels.reference.ragged_paged_attention`:
q[T, Hq, D] against one layer's pages [num_blocks, block_size, Hkv, D], with a ragged batch
described by seq_lens / query_start_loc / block_tables / num_seqs. The engine picks a backend
by name (`--attention-backend`); `xla` is the portable default, `pallas` the kernel path.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class AttentionMetadata(NamedTuple):
    """Per-step batch layout, shared by all layers (a pytree of device arrays)."""

    slot_mapping: jax.Array  # i32[T] flat KV slot each new token writes (padding -> null block 0)
    seq_lens: jax.Array  # i32[S] context length incl. this step's tokens (0 for padding seqs)
    query_start_loc: jax.Array  # i32[S+1] cumulative new-token counts
    block_tables: jax.Array  # i32[S, max_blocks]
    num_seqs: jax.Array  # i32[1]


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter this step's K/V rows into their slots. Pages are donated, so this is in place."""
    nb, bs, hkv, d = k_pages.shape
    k_pages = k_pages.reshape(nb * bs, hkv, d).at[slot_mapping].set(k.astype(k_pages.dtype))
    v_pages = v_pages.reshape(nb * bs, hkv, d).at[slot_mapping].set(v.astype(v_pages.dtype))
    return k_pages.reshape(nb, bs, hkv, d), v_pages.reshape(nb, bs, hkv, d)


def xla_ragged_paged_attention(
    q,  # [T, Hq, D]
    k_pages,  # [num_blocks, block_size, Hkv, D]
    v_pages,  # [num_blocks, block_size, Hkv, D]
    seq_lens,  # i32[S]
    query_start_loc,  # i32[S+1]
    block_tables,  # i32[S, max_blocks]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    blocks_per_chunk: int = 8,
):
    """Flash-style attention in plain XLA: loop over chunks of KV blocks with an online softmax.

    The loop runs only as far as the longest context in the batch (a dynamic trip count, so no
    recompilation as contexts grow), and each token gathers only its own sequence's pages.
    """
    t, hq, d = q.shape
    _, bs, hkv, _ = k_pages.shape
    g = hq // hkv
    s_max, max_blocks = block_tables.shape
    n = num_seqs[0]
    chunk = blocks_per_chunk * bs

    # Each token's sequence, position, and whether it is real.
    tok = jnp.arange(t, dtype=jnp.int32)
    seq_id = jnp.searchsorted(query_start_loc[1:], tok, side="right").astype(jnp.int32)
    valid = tok < query_start_loc[n]
    seq_id = jnp.minimum(seq_id, s_max - 1)
    q_len = query_start_loc[seq_id + 1] - query_start_loc[seq_id]
    pos = seq_lens[seq_id] - q_len + (tok - query_start_loc[seq_id])  # i32[T]
    ctx_len = jnp.where(valid, pos + 1, 0)

    pad_cols = (-max_blocks) % blocks_per_chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, pad_cols)))[seq_id]  # i32[T, padded_blocks]
    num_chunks = (jnp.max(ctx_len) + chunk - 1) // chunk

    qf = q.reshape(t, hkv, g, d).astype(jnp.float32) * sm_scale

    def body(i, carry):
        m, l, acc = carry
        blk = jax.lax.dynamic_slice_in_dim(tables, i * blocks_per_chunk, blocks_per_chunk, axis=1)
        k = k_pages[blk].reshape(t, chunk, hkv, d).astype(jnp.float32)
        v = v_pages[blk].reshape(t, chunk, hkv, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = kv_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((t, hkv, g), -jnp.inf, jnp.float32),
        jnp.zeros((t, hkv, g), jnp.float32),
        jnp.zeros((t, hkv, g, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


AttentionFn = Callable[..., jax.Array]
BACKENDS = ("xla", "pallas")


def get_backend(name: str) -> AttentionFn:
    if name == "xla":
        return xla_ragged_paged_attention
    if name == "pallas":
        import functools

        from pallas_kernels import ragged_paged_attention

        # No Pallas lowering for CPU: run the kernel in interpret mode there (tests, numerics).
        return functools.partial(ragged_paged_attention, interpret=jax.default_backend() == "cpu")
    raise ValueError(f"Unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}.")
