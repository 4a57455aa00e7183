"""Attention backends: write new K/V into the paged cache, then ragged paged attention.

A *kernel* has the signature of `pallas_kernels.reference.ragged_paged_attention`: q[T, Hq, D]
against one layer's pages [num_blocks, block_size, Hkv, D], with a ragged batch described by
seq_lens / query_start_loc / block_tables / num_seqs. A *backend* (what the model calls, see
`layer_attention`) pairs a kernel with a KV write. The backend (backend.py) picks one by name once
(`--attention-backend`): `pallas` is the kernel path on TPU/GPU, `cpu` a native kernel and write
for XLA:CPU (cpu_kernels.py, the `cpu-tiled` KV layout), `xla` the portable fallback.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp

# The XLA KV write is one scatter (in place: the pages are donated). pallas_kernels.write_kv has a
# Mosaic TPU kernel too; it is not wired in yet.
from pallas_kernels.kv_quant import gather as load_pages
from pallas_kernels.reference import token_layout, write_kv  # noqa: F401  (re-exported)


class AttentionMetadata(NamedTuple):
    """Per-step batch layout, shared by all layers (a pytree of device arrays)."""

    slot_mapping: jax.Array  # i32[T] flat KV slot each new token writes (padding -> null block 0)
    seq_lens: jax.Array  # i32[S] context length incl. this step's tokens (0 for padding seqs)
    query_start_loc: jax.Array  # i32[S+1] cumulative new-token counts
    block_tables: jax.Array  # i32[S, max_blocks]
    num_seqs: jax.Array  # i32[1]


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
    decode_rows: int = 16,
    decode_blocks_per_chunk: int = 2,
    prefill_rows: int = 128,
    blocks_per_chunk: int = 8,
):
    """Ragged paged attention in plain XLA: flash-style loops with dynamic trip counts.

    Decode rows (sequences with one new token) each read their own sequence's pages, a block of
    rows at a time. Prefill rows (several new tokens) are taken in tiles; for each sequence in a
    tile its pages are read once, chunk by chunk, and scored against all the tile's rows with one
    matmul. Nothing is read past the longest context in play, so nothing recompiles as contexts
    grow. The batch builder puts decode rows first, which keeps both loops short; any order is
    still correct.
    """
    t, hq, d = q.shape
    nb, bs, hkv, _ = k_pages.shape
    g = hq // hkv
    s_max, max_blocks = block_tables.shape
    chunk = blocks_per_chunk * bs
    dchunk, dbpc = decode_blocks_per_chunk * bs, decode_blocks_per_chunk
    rd, rp = min(decode_rows, t), min(prefill_rows, t)

    seq, pos, valid = token_layout(seq_lens, query_start_loc, num_seqs, t)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    is_decode = valid & (q_len == 1)
    tables = jnp.pad(block_tables, ((0, 0), (0, (-max_blocks) % math.lcm(blocks_per_chunk, dbpc))))
    qf = q.reshape(t, hkv, g, d).astype(jnp.float32) * sm_scale
    pad = max(rd, rp)
    padded = lambda x, v=0: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=v)  # noqa: E731
    seq_p, pos_p, valid_p, qf_p = padded(seq), padded(pos, -1), padded(valid, False), padded(qf)

    def cap(x):
        return x if soft_cap is None else soft_cap * jnp.tanh(x / soft_cap)

    def visible(kv_pos, row_pos):  # bool[R, C]: causal (and window) visibility
        ok = kv_pos[None, :] <= row_pos[:, None]
        if sliding_window is not None:
            ok &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        return ok

    def online(carry, sc, v, ok, vspec):
        """One online-softmax update. sc: [R, Hkv, G, C] scores; v: values matching the C axis."""
        m, l, acc = carry
        sc = jnp.where(ok, cap(sc), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(sc - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + jnp.einsum(vspec, p, v)

    def empty(r):
        return jnp.full((r, hkv, g), -jnp.inf), jnp.zeros((r, hkv, g)), jnp.zeros((r, hkv, g, d))

    tp = t + pad
    m_all, l_all, acc_all = empty(tp)

    # Decode rows: per-row page gather.
    num_decode_blocks = (jnp.max(jnp.where(is_decode, jnp.arange(t), -1)) + rd) // rd

    def decode_block(i, carry):
        start = i * rd
        rseq = jax.lax.dynamic_slice_in_dim(seq_p, start, rd)
        rpos = jax.lax.dynamic_slice_in_dim(pos_p, start, rd)
        rq = jax.lax.dynamic_slice_in_dim(qf_p, start, rd)
        rtab = tables[rseq]

        def kv_chunk(c, inner):
            blk = jax.lax.dynamic_slice_in_dim(rtab, c * dbpc, dbpc, axis=1)
            kv_pos = c * dchunk + jnp.arange(dchunk, dtype=jnp.int32)
            ok = visible(kv_pos, rpos)
            k = load_pages(k_pages, blk).reshape(rd, dchunk, hkv, d)
            v = jnp.where(ok[:, :, None, None], load_pages(v_pages, blk).reshape(rd, dchunk, hkv, d), 0.0)
            return online(inner, jnp.einsum("rkgd,rckd->rkgc", rq, k), v, ok[:, None, None, :], "rkgc,rckd->rkgd")

        num_chunks = (jnp.max(rpos) + dchunk) // dchunk
        m, l, acc = jax.lax.fori_loop(0, num_chunks, kv_chunk, empty(rd))
        m_all, l_all, acc_all = carry
        upd = jax.lax.dynamic_update_slice_in_dim
        return upd(m_all, m, start, 0), upd(l_all, l, start, 0), upd(acc_all, acc, start, 0)

    carry = jax.lax.fori_loop(0, num_decode_blocks, decode_block, (m_all, l_all, acc_all))

    # Prefill rows: tiles starting after the decode rows; pages read once per (tile, sequence).
    first = jnp.min(jnp.where(valid & ~is_decode, jnp.arange(t), t))
    last = jnp.max(jnp.where(valid & ~is_decode, jnp.arange(t), -1))
    num_tiles = jnp.where(last >= first, (last - first + rp) // rp, 0)

    def prefill_tile(i, carry):
        start = first + i * rp
        rseq = jax.lax.dynamic_slice_in_dim(seq_p, start, rp)
        rpos = jax.lax.dynamic_slice_in_dim(pos_p, start, rp)
        rvalid = jax.lax.dynamic_slice_in_dim(valid_p, start, rp)
        rq = jax.lax.dynamic_slice_in_dim(qf_p, start, rp)
        s_first = rseq[0]
        s_last = jnp.max(jnp.where(rvalid, rseq, s_first))

        def one_seq(sid, inner):
            mine = rvalid & (rseq == sid)
            top = jnp.max(jnp.where(mine, rpos, -1))

            def kv_chunk(c, inner2):
                blk = jax.lax.dynamic_slice_in_dim(tables[sid], c * blocks_per_chunk, blocks_per_chunk)
                kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
                ok = visible(kv_pos, rpos) & mine[:, None]
                k = load_pages(k_pages, blk).reshape(chunk, hkv, d)
                v = jnp.where((kv_pos <= top)[:, None, None], load_pages(v_pages, blk).reshape(chunk, hkv, d), 0.0)
                return online(inner2, jnp.einsum("rkgd,ckd->rkgc", rq, k), v, ok[:, None, None, :], "rkgc,ckd->rkgd")

            return jax.lax.fori_loop(0, (top + chunk) // chunk, kv_chunk, inner)

        m, l, acc = jax.lax.fori_loop(s_first, s_last + 1, one_seq, empty(rp))
        m_all, l_all, acc_all = carry
        upd = jax.lax.dynamic_update_slice_in_dim
        return upd(m_all, m, start, 0), upd(l_all, l, start, 0), upd(acc_all, acc, start, 0)

    _, l_all, acc_all = jax.lax.fori_loop(0, num_tiles, prefill_tile, carry)
    l_all, acc_all = l_all[:t], acc_all[:t]
    out = acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


KernelFn = Callable[..., jax.Array]
# (q, k_new, v_new, k_pages, v_pages, md, *, sm_scale, sliding_window) -> (out, k_pages, v_pages)
AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
BACKENDS = ("xla", "pallas", "cpu")
log = logging.getLogger(__name__)


def get_backend(name: str, platform: str | None = None, decode_only: bool = False) -> KernelFn:
    """The attention kernel of a backend; ``platform`` (gpu/tpu) names the Pallas kernel's target
    when it is not this host's (`jaxserve lower` exports for it). ``decode_only``: a step of one
    decode token per sequence, token t of sequence t (pallas: the split-KV kernel on GPU, the
    decode block sizes on TPU; the other backends serve every step alike)."""
    if name == "xla":
        return xla_ragged_paged_attention
    if name == "pallas":
        import pallas_kernels

        kernel = {"gpu": "gpu", "tpu": "tpu"}.get(platform, "auto")
        # No Pallas lowering for CPU: run the kernel in interpret mode there (tests, numerics).
        interpret = kernel == "auto" and jax.default_backend() == "cpu"
        return pallas_kernels.for_step(decode_only=decode_only, backend=kernel, interpret=interpret)
    if name == "cpu":
        from jaxserve.runtime import cpu_kernels

        return cpu_kernels.cpu_ragged_paged_attention
    raise ValueError(f"Unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}.")


def layer_attention(name: str, platform: str | None = None, decode_only: bool = False) -> AttentionFn:
    """What one model layer calls: write this step's K/V into its pages, then attend over them."""
    kernel = get_backend(name, platform, decode_only)
    write = write_kv
    if name == "cpu":
        from jaxserve.runtime.cpu_kernels import cpu_write_kv as write

    def attend(q, k, v, k_pages, v_pages, md: AttentionMetadata, **kw):
        k_pages, v_pages = write(k_pages, v_pages, k, v, md.slot_mapping)
        out = kernel(q, k_pages, v_pages, md.seq_lens, md.query_start_loc, md.block_tables, md.num_seqs, **kw)
        return out, k_pages, v_pages

    return attend
