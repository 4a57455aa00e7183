"""Split-KV (flash-decoding) attention for decode-only steps on NVIDIA GPU (Mosaic GPU).

A decode step has one new token per sequence. The general kernel (``gpu``) gives each CTA a
tile of 64 q rows, i.e. ``64 // G`` sequences, so at batch 1-64 it launches a handful of CTAs
on a 132-SM GPU and each walks a whole context. Here one CTA takes one (sequence, kv head,
context split): the G query heads of the group are the rows of the MMA (padded to its 64), the
sequence's visible pages are cut into ``num_splits`` equal ranges, and each CTA streams its
range through the same TMA ring and online softmax as ``gpu``. Each writes
its normalized partial output and log-sum-exp; a small XLA combine weighs the splits.

``num_splits`` and ``pages_per_chunk`` come from ``decode_config``: chunk tokens from the
head_dim table that the general kernel uses, splits so the grid has about two CTAs per SM.
The decode contract: token t belongs to sequence t (query_start_loc[t] = t for real ones).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels import common, gpu

TARGET_CTAS = 2 * 132  # two per SM on an H100/H200
MAX_SPLITS = 16
LSE_COLS = 32  # one 128-byte swizzle row of f32: the lse is stored broadcast over these
OUT_ROWS = 8  # rows of each CTA's tile written back: G rounded up to the 8-row tile


def decode_config(
    head_dim: int, group: int, block_size: int, num_tokens: int, num_kv_heads: int,
    max_blocks: int,
) -> tuple[int, int]:
    """(pages_per_chunk, num_splits) for a decode bucket; static, from shapes only."""
    del group  # G rides in the MMA's padded rows: it changes neither the bytes nor the grid
    pages_per_chunk = gpu.default_pages_per_chunk(head_dim, block_size)
    max_chunks = max(1, -(-max_blocks // pages_per_chunk))
    want = -(-TARGET_CTAS // max(1, num_tokens * num_kv_heads))
    return pages_per_chunk, max(1, min(want, max_chunks, MAX_SPLITS))


def decode_attention(
    q: jax.Array,  # [T, Hq, D] bf16/f16, one token per sequence
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1], = arange for real sequences
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_chunk: int | None = None,
    num_splits: int | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """``sinks``: f32[Hq] sink logits, taken into the combine's softmax sum (``combine``)."""
    del query_start_loc  # the decode contract fixes it
    num_tokens, _, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group, pages_per_chunk = gpu.validate(q, k_pages, v_pages, pages_per_chunk)
    out_rows = common.round_up(group, OUT_ROWS)
    num_seqs_max, max_blocks = block_tables.shape
    if num_splits is None:
        _, num_splits = decode_config(head_dim, group, block_size, num_tokens, num_kv_heads,
                                      max_blocks)
    dtype = q.dtype
    chunk = pages_per_chunk * block_size
    ops = gpu.Ops(interpret)

    # Token t <-> sequence t; tokens past the real sequences get length 0 (zero output).
    lens = jnp.zeros((num_tokens,), jnp.int32).at[: min(num_tokens, num_seqs_max)].set(
        seq_lens[:num_tokens].astype(jnp.int32)
    )
    lens = jnp.where(jnp.arange(num_tokens) < num_seqs[0], lens, 0)
    tables = jnp.zeros((num_tokens, max_blocks), jnp.int32).at[: min(num_tokens, num_seqs_max)]
    tables = tables.set(block_tables[:num_tokens].astype(jnp.int32)).reshape(-1)
    q_rows = common.to_rows(q, num_kv_heads, 1, gpu.ROWS)  # [Hkv, T * 64, D]

    (k_data, v_data), scales = gpu.page_arrays(k_pages, v_pages)

    def body(lens_g, tables_g, q_g, k_g, v_g, *rest):
        *scales_g, o_g, lse_g, scoped = rest
        q_smem, q_bar, lse_smem = scoped[0], scoped[3], scoped[-1]
        seq = lax.axis_index("seq")
        head = lax.axis_index("head")
        split = lax.axis_index("split")

        plgpu.copy_gmem_to_smem(q_g.at[head, pl.ds(seq * gpu.ROWS, gpu.ROWS)], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        kv_len = lens_g[seq]
        kv_begin = jnp.int32(0)
        if sliding_window is not None:
            kv_begin = jnp.maximum(kv_len - sliding_window, 0)
        num_pages = lax.div(kv_len + (block_size - 1), jnp.int32(block_size))
        first = lax.div(kv_begin, jnp.int32(block_size))
        per_split = lax.div(num_pages - first + (num_splits - 1), jnp.int32(num_splits))
        p_lo = first + split * per_split
        p_hi = jnp.minimum(p_lo + per_split, num_pages)
        n_chunks = jnp.where(
            p_hi > p_lo, lax.div(p_hi - p_lo + (pages_per_chunk - 1), pages_per_chunk), 0
        )
        kv_lo = jnp.maximum(p_lo * block_size, kv_begin)
        kv_hi = jnp.minimum(p_hi * block_size, kv_len)
        col = ops.iota((gpu.ROWS, chunk), 1)
        copy = gpu.page_fetcher(scoped, k_g, v_g, head, block_size, scales_g)

        def fetch(c, slot):
            # Past this split's last page, re-fetch it (static arrival count, never the null block).
            copy(slot, [
                tables_g[seq * max_blocks + jnp.minimum(p_lo + c * pages_per_chunk + j, p_hi - 1)]
                for j in range(pages_per_chunk)
            ])

        def mask_of(c):
            kv_pos = (p_lo + c * pages_per_chunk) * block_size + col
            return (kv_pos >= kv_lo) & (kv_pos < kv_hi)

        acc, m_i, l_i = gpu.stream_chunks(
            ops, scoped, fetch=fetch, mask_of=mask_of, c_lo=jnp.int32(0), c_hi=n_chunks,
            carry=ops.init_carry(head_dim), sm_scale=sm_scale, soft_cap=soft_cap, dtype=dtype, head=head,
        )
        # log2-domain log-sum-exp of this split; MASK_VALUE where it saw nothing.
        lse = jnp.where(l_i > 0.0, m_i + jnp.log2(jnp.where(l_i > 0.0, l_i, 1.0)),
                        common.MASK_VALUE)
        q_smem[...] = gpu.normalized(acc, l_i).astype(dtype)
        lse_smem[...] = lax.broadcast_in_dim(lse, (gpu.ROWS, LSE_COLS), [0])
        plgpu.commit_smem()
        row0 = (seq * num_splits + split) * out_rows
        plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(0, out_rows)], o_g.at[head, pl.ds(row0, out_rows)])
        plgpu.copy_smem_to_gmem(
            lse_smem.at[pl.ds(0, out_rows)], lse_g.at[head, pl.ds(row0, out_rows)]
        )
        plgpu.wait_smem_to_gmem(0)

    lse_smem = plgpu.SMEM((gpu.ROWS, LSE_COLS), jnp.float32,
                          transforms=gpu.smem_transforms(LSE_COLS, jnp.float32))
    rows = num_tokens * num_splits * out_rows
    stages = gpu.num_stages(head_dim, chunk, dtype, extra=gpu.ROWS * LSE_COLS * 4, kv_dtype=k_data.dtype,
                            block_size=block_size)

    def rpa_decode(*refs):  # named: the kernel's name in ptxas' report and profiles
        return pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            *gpu.scratch(head_dim, chunk, pages_per_chunk, dtype, stages, k_data.dtype), lse_smem,
        )

    kernel = plgpu.kernel(
        rpa_decode,
        out_type=(
            jax.ShapeDtypeStruct((num_kv_heads, rows, head_dim), dtype),
            jax.ShapeDtypeStruct((num_kv_heads, rows, LSE_COLS), jnp.float32),
        ),
        grid=(num_tokens, num_kv_heads, num_splits),
        grid_names=("seq", "head", "split"),
        compiler_params=compat.gpu_compiler_params(approx_math=True),
        interpret=compat.gpu_interpret_params() if interpret else None,
    )
    o_part, lse = kernel(lens, tables, q_rows, k_data, v_data, *scales)
    if sinks is not None:
        sinks = gpu.check_sinks(sinks, q.shape[1])
    return combine(o_part, lse, num_tokens, num_splits, group, sinks)


def combine(o_part, lse, num_tokens: int, num_splits: int, group: int, sinks=None) -> jax.Array:
    """Weigh each split's normalized output by its share of the softmax mass: [T, Hq, D]. With
    ``sinks`` (f32[Hq]) each head's sink logit joins the mass (and the max) as one more split
    that contributes no value: the kernel itself needs no sink."""
    num_kv_heads, _, head_dim = o_part.shape
    o = o_part.reshape(num_kv_heads, num_tokens, num_splits, -1, head_dim)[:, :, :, :group]
    lse = lse.reshape(num_kv_heads, num_tokens, num_splits, -1, lse.shape[-1])[:, :, :, :group, 0]
    seen = lse > common.MASK_VALUE / 2
    top = jnp.max(jnp.where(seen, lse, common.MASK_VALUE), axis=2, keepdims=True)
    if sinks is not None:  # the log2 domain of the kernel's lse
        sink = (sinks * math.log2(math.e)).reshape(num_kv_heads, 1, 1, group)
        top = jnp.maximum(top, sink)
    w = jnp.where(seen, jnp.exp2(lse - top), 0.0)  # [Hkv, T, splits, G]
    total = w.sum(axis=2, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp2(sink - top)
    w = w / jnp.where(total > 0.0, total, 1.0)
    out = jnp.einsum("htsg,htsgd->htgd", w, o.astype(jnp.float32))
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_kv_heads * group, head_dim)
    return out.astype(o_part.dtype)
