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
    rows_per_block: int = 64,
    blocks_per_chunk: int = 8,
):
    """Ragged paged attention in plain XLA, in two parts merged by their softmax statistics.

    1. This step's own tokens attend to each other (same sequence, causal) densely: no page reads.
    2. Each token attends to its sequence's *earlier* context (computed in previous steps) through
       the block table: a loop over row blocks of tokens that have such a prefix, and inside it a
       loop over chunks of pages up to the longest prefix in the row block. Both trip counts are
       dynamic, so a fresh prefill reads no pages at all and nothing recompiles as contexts grow.
    The batch builder puts rows with a prefix first, which keeps the outer loop short.
    """
    t, hq, d = q.shape
    nb, bs, hkv, _ = k_pages.shape
    g = hq // hkv
    max_blocks = block_tables.shape[1]
    r = min(rows_per_block, t)
    chunk = blocks_per_chunk * bs

    seq, pos, valid = _token_layout(seq_lens, query_start_loc, num_seqs, t)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    prefix = jnp.where(valid, seq_lens[seq] - q_len, 0)  # i32[T] context written before this step
    qf = q.reshape(t, hkv, g, d).astype(jnp.float32) * sm_scale

    def cap(s):
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    # Part 1: the step's own tokens, read back from their slots (they were just written).
    slot = block_tables[seq, jnp.minimum(pos // bs, max_blocks - 1)] * bs + pos % bs
    real = valid[:, None, None]
    k_new = jnp.where(real, k_pages.reshape(nb * bs, hkv, d)[slot].astype(jnp.float32), 0.0)
    v_new = jnp.where(real, v_pages.reshape(nb * bs, hkv, d)[slot].astype(jnp.float32), 0.0)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & valid[:, None] & valid[None, :]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    s = cap(jnp.einsum("tkgd,ukd->tkgu", qf, k_new))
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m1 = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m1), m1, 0.0)[..., None])
    l1 = jnp.sum(p, axis=-1)
    acc1 = jnp.einsum("tkgu,ukd->tkgd", p, v_new)

    # Part 2: the earlier context, through the block tables.
    tables = jnp.pad(block_tables, ((0, 0), (0, (-max_blocks) % blocks_per_chunk)))
    has_prefix = prefix > 0
    last_row = jnp.max(jnp.where(has_prefix, jnp.arange(t), -1))
    num_row_blocks = (last_row + r) // r
    pad_t = (-t) % r  # row blocks must tile T; padded rows have no prefix
    padded = lambda x, v=0: jnp.pad(x, [(0, pad_t)] + [(0, 0)] * (x.ndim - 1), constant_values=v)  # noqa: E731
    seq_p, pos_p, prefix_p, qf_p = padded(seq), padded(pos), padded(prefix), padded(qf)

    def row_block(i, carry):
        m_all, l_all, acc_all = carry
        start = i * r
        rseq = jax.lax.dynamic_slice_in_dim(seq_p, start, r)
        rpos = jax.lax.dynamic_slice_in_dim(pos_p, start, r)
        rpre = jax.lax.dynamic_slice_in_dim(prefix_p, start, r)
        rq = jax.lax.dynamic_slice_in_dim(qf_p, start, r)
        rtab = tables[rseq]  # i32[R, padded_blocks]

        def kv_chunk(c, inner):
            m, l, acc = inner
            blk = jax.lax.dynamic_slice_in_dim(rtab, c * blocks_per_chunk, blocks_per_chunk, axis=1)
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            ok = kv_pos[None, :] < rpre[:, None]
            if sliding_window is not None:
                ok &= kv_pos[None, :] > rpos[:, None] - sliding_window
            k = k_pages[blk].reshape(r, chunk, hkv, d).astype(jnp.float32)
            v = jnp.where(ok[:, :, None, None], v_pages[blk].reshape(r, chunk, hkv, d).astype(jnp.float32), 0.0)
            sc = jnp.where(ok[:, None, None, :], cap(jnp.einsum("tkgd,tckd->tkgc", rq, k)), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            pc = jnp.exp(sc - m_safe[..., None])
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
            return m_new, l * corr + jnp.sum(pc, axis=-1), acc * corr[..., None] + jnp.einsum("tkgc,tckd->tkgd", pc, v)

        init = (jnp.full((r, hkv, g), -jnp.inf), jnp.zeros((r, hkv, g)), jnp.zeros((r, hkv, g, d)))
        num_chunks = (jnp.max(rpre) + chunk - 1) // chunk
        m, l, acc = jax.lax.fori_loop(0, num_chunks, kv_chunk, init)
        return (
            jax.lax.dynamic_update_slice_in_dim(m_all, m, start, 0),
            jax.lax.dynamic_update_slice_in_dim(l_all, l, start, 0),
            jax.lax.dynamic_update_slice_in_dim(acc_all, acc, start, 0),
        )

    tp = t + pad_t
    init = (jnp.full((tp, hkv, g), -jnp.inf), jnp.zeros((tp, hkv, g)), jnp.zeros((tp, hkv, g, d)))
    m2, l2, acc2 = jax.lax.fori_loop(0, num_row_blocks, row_block, init)
    m2, l2, acc2 = m2[:t], l2[:t], acc2[:t]

    # Merge the two parts.
    m = jnp.maximum(m1, m2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    c1 = jnp.exp(jnp.where(jnp.isfinite(m1), m1 - m_safe, -jnp.inf))
    c2 = jnp.exp(jnp.where(jnp.isfinite(m2), m2 - m_safe, -jnp.inf))
    l = l1 * c1 + l2 * c2
    out = (acc1 * c1[..., None] + acc2 * c2[..., None]) / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


def _token_layout(seq_lens, query_start_loc, num_seqs, t):
    """Per token: (sequence index, absolute position, is-real)."""
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], tok, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, seq_lens.shape[0] - 1)
    valid = tok < query_start_loc[num_seqs[0]]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + (tok - query_start_loc[seq])
    return seq, pos, valid


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
