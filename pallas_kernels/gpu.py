"""Ragged paged attention for NVIDIA GPU (Pallas / Mosaic GPU, Hopper sm_90a first).

Why Mosaic GPU and not Triton: the Triton backend is deprecated upstream, and Mosaic GPU can
express the page gather directly — each page is one TMA copy whose source ``k_pages.at[block, :,
head, :]`` takes its block id from a scalar loaded from the block table, and a barrier with
``pages_per_chunk`` arrivals completes when a whole chunk of pages has landed.

One CTA = one warpgroup = one kv head x one tile of 64 q rows (``64 // G`` tokens, rows laid out
as in ``common``). For every sequence overlapping the tile it streams that tile's visible KV
range in chunks of ``pages_per_chunk`` pages through a ring of 2-4 SMEM slots (the next chunks'
TMAs are in flight while chunk c runs on the tensor cores), QK^T and PV as WGMMA with f32 accumulation,
online softmax in registers. Chunk slots past a sequence's last page re-fetch that page (so the
barrier arrival count is static) and are masked out; masked probabilities are exactly 0, so the
kernel needs finite K/V in the slots of a sequence's own pages (stale slots past its length
included) but never reads the null block or other sequences' pages.

Inputs must be bfloat16 or float16 (WGMMA operands); ``unsupported`` says which shapes run. Any
GQA ratio G <= 64 works: a tile holds ``64 // G`` tokens and pads its rows to 64.

Quantized pages (``kv_quant.QuantPages``: int8 / fp8 data, a float32 scale per token and kv
head) stream through the same ring in their own dtype, half the bytes of bfloat16. A chunk is
widened (exactly; fp8 through float16, the only fp8 cast Mosaic GPU emits for sm_90) into one
compute-dtype SMEM tile for the MMA; the K scales multiply the chunk's score columns and the V
scales its probabilities (after the softmax sum), so no element is ever multiplied by a scale.
The scales travel as ``page_arrays`` lays them out per call, [nb, Hkv, 2 (K, V), bs padded to
16] f32: one TMA per (page, head) of a multiple of 128 bytes (Pallas' warpgroup copies need that;
a 16-token page's 64 bytes of K scales alone are too small), landing on the K barrier, into a
[pages, 2, scale_width] slot per stage. Each chunk's K or V scales are one load of the [pages, bs] view of
that slot in the scores' column layout (``Layout.WGMMA.reduce(0)``), reshaped to [chunk] (pages
end to end) and broadcast over the rows. 1-byte page rows must fill an SMEM swizzle (32 bytes at
least), so head_dim 80 has no quantized path (``unsupported``). Lowering for sm_90a is tested
(tests/kernels/test_lowering.py, jax.export from a CPU host, no ptxas); the numerics are tested
in the interpreter only, not yet on a GPU.

Attention sinks (gpt-oss, ``sinks`` f32[Hq]): after a tile's last chunk each row's sink logit
joins its softmax sum (``with_sinks``: G scalar loads per CTA, no SMEM); the split-KV decode
kernel leaves them to its XLA combine. Shapes, budgets and the launch plan are in ``gpu_plan``,
the Mosaic GPU operations (and their interpreter substitutes) in ``gpu_ops``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, compat
from pallas_kernels.gpu_ops import Ops
from pallas_kernels.gpu_plan import (CHUNK_TOKENS, DTYPES, HEAD_DIMS, MAX_STAGES, QUANT_CHUNK_TOKENS, ROWS,
                                     SMEM_BYTES, default_pages_per_chunk, num_stages, scale_width, smem_bytes,
                                     swizzle_bytes, unsupported)
from pallas_kernels.kv_quant import KV_QUANT_DTYPES, QuantPages

# The planning names, re-exported: callers know them as gpu.<name>.
__all__ = ["CHUNK_TOKENS", "DTYPES", "HEAD_DIMS", "MAX_STAGES", "QUANT_CHUNK_TOKENS", "ROWS", "SMEM_BYTES",
           "default_pages_per_chunk", "num_stages", "scale_width", "smem_bytes", "swizzle_bytes",
           "unsupported", "Ops", "page_arrays", "page_fetcher", "ragged_paged_attention", "scratch",
           "smem_transforms", "stream_chunks", "validate", "normalized", "with_sinks", "check_sinks"]

def smem_transforms(head_dim: int, dtype):
    swizzle = swizzle_bytes(head_dim, dtype)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def scratch(head_dim: int, chunk: int, pages_per_chunk: int, dtype, stages: int, kv_dtype=None):
    """q/out tile, a ring of ``stages`` K and V chunks, their barriers (one arrival per page);
    for quantized pages (``kv_dtype``) the ring holds that dtype, and three more: a scale slot
    per stage [pages_per_chunk, 2 (K, V), scale_width] landing on the K barrier (one more arrival
    per page) and the widened K and V tiles."""
    transforms = smem_transforms(head_dim, dtype)
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    quant = kv_dtype != jnp.dtype(dtype)
    ring = smem_transforms(head_dim, kv_dtype)
    base = (
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, chunk, head_dim), kv_dtype, transforms=ring),
        plgpu.SMEM((stages, chunk, head_dim), kv_dtype, transforms=ring),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pages_per_chunk * (2 if quant else 1), num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_chunk, num_barriers=stages),
    )
    if not quant:
        return base
    width = scale_width(chunk // pages_per_chunk)
    return base + (
        plgpu.SMEM((stages, pages_per_chunk, 2, width), jnp.float32),
        plgpu.SMEM((chunk, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((chunk, head_dim), dtype, transforms=transforms),
    )


def stream_chunks(ops, scoped, *, fetch, mask_of, c_lo, c_hi, carry, sm_scale, soft_cap, dtype, head=None):
    """Online softmax over chunks [c_lo, c_hi) through a ring of ``stages`` SMEM slots: while
    chunk c is on the tensor cores, the TMAs (``fetch(c, slot)``) of the next ``stages - 1``
    chunks are in flight. ``mask_of(c)`` is the chunk's [ROWS, chunk] visibility; masked
    probabilities are exactly 0, so masked slots need finite (not meaningful) K/V. Quantized
    pages (``scratch`` with a kv_dtype): ``head`` picks the kv head's column of the scales."""
    q_smem, k_smem, v_smem, _, k_bar, v_bar = scoped[:6]
    quant = k_smem.dtype != jnp.dtype(dtype)
    stages = k_smem.shape[0]
    if quant:
        block_size = k_smem.shape[1] // scoped[6].shape[1]
    log2e = math.log2(math.e)

    for i in range(stages - 1):
        @pl.when(c_lo + i < c_hi)
        def _(i=i):
            fetch(c_lo + i, i)

    def chunk_body(c, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(c - c_lo, jnp.int32(stages))
        ahead = c + (stages - 1)

        @pl.when(ahead < c_hi)  # into the slot chunk c-1 has just released
        def _():
            fetch(ahead, lax.rem(ahead - c_lo, jnp.int32(stages)))

        plgpu.barrier_wait(k_bar.at[slot])
        if quant:
            s_smem, k_wide, v_wide = scoped[6:9]
            s = ops.mma_qk(q_smem, ops.widen(k_smem.at[slot], k_wide))
            s = s * lax.broadcast_in_dim(ops.scales(s_smem.at[slot], 0, block_size) * sm_scale, s.shape, [1])
        else:
            s = ops.mma_qk(q_smem, k_smem.at[slot]) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = mask_of(c)
        s = jnp.where(mask, s * log2e, common.MASK_VALUE)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        v_ref = v_smem.at[slot]
        if quant:  # V scales on the probabilities, after their sum l_i
            p = p * lax.broadcast_in_dim(ops.scales(s_smem.at[slot], 1, block_size), p.shape, [1])
            v_ref = ops.widen(v_ref, v_wide)
        acc = acc + ops.mma_pv(p.astype(dtype), v_ref)
        return acc, m_new, l_i

    return lax.fori_loop(c_lo, c_hi, chunk_body, carry)


def page_fetcher(scoped, k_g, v_g, head, block_size, scales_g=()):
    """``fetch(slot, block_ids)``: one TMA per (K|V, page) of a chunk into ``slot``; with
    quantized pages (``scales_g``: the K and V scale arrays) one more per page for its scales."""
    _, k_smem, v_smem, _, k_bar, v_bar = scoped[:6]

    def fetch(slot, block_ids):
        for j, block in enumerate(block_ids):
            dst = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_g.at[block, :, head, :], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_g.at[block, :, head, :], v_smem.at[slot, dst], v_bar.at[slot])
            if scales_g:  # the head's K and V scales of a page: [2, scale_width] floats, one copy
                plgpu.copy_gmem_to_smem(scales_g[0].at[block, head], scoped[6].at[slot, j], k_bar.at[slot])

    return fetch


def page_arrays(k_pages, v_pages) -> tuple[tuple, tuple]:
    """((k, v) data arrays, (scales,) or ()) as the kernels take them: for quantized pages the
    K and V scales of each (page, kv head) side by side, [nb, Hkv, 2, scale_width(bs)] f32.

    This is a copy of every scale per call (~4/D of the data's bytes, twice): TMA needs each
    (page, head) run of scales contiguous, which the [nb, bs, Hkv] scales are not, and a copy
    of a multiple of 128 bytes (K and V together, padded to 16 tokens)."""
    if isinstance(k_pages, QuantPages):
        block_size = k_pages.shape[1]
        pad = scale_width(block_size) - block_size
        scales = jnp.stack([k_pages.scale, v_pages.scale], axis=1).transpose(0, 3, 1, 2)
        return (k_pages.data, v_pages.data), (jnp.pad(scales, ((0, 0), (0, 0), (0, 0), (0, pad))),)
    return (k_pages, v_pages), ()


def with_sinks(ops, sinks_g, head, group: int, carry):
    """Attention sinks (gpt-oss) into a tile's finished online softmax: row r of kv head ``head``
    is query head ``head * group + r % group``, whose sink logit (``sinks_g``: f32[Hq] in GMEM,
    read as G scalars) joins the softmax sum relative to the larger of the row's running max and
    the sink (the log2 domain of ``stream_chunks``), and takes mass without adding value."""
    acc, m_i, l_i = carry
    row = ops.layout_cast(lax.broadcasted_iota(jnp.int32, (ROWS,), 0), plgpu.Layout.WGMMA.reduce(1))
    j_of_row = lax.rem(row, jnp.int32(group))
    sink = jnp.zeros((ROWS,), jnp.float32) + sinks_g[head * group]
    for j in range(1, group):  # static: G scalar loads, once per CTA
        sink = jnp.where(j_of_row == j, sinks_g[head * group + j], sink)
    sink = sink * math.log2(math.e)
    m_new = jnp.maximum(m_i, sink)
    alpha = jnp.exp2(m_i - m_new)
    l_i = l_i * alpha + jnp.exp2(sink - m_new)
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), m_new, l_i


def normalized(acc, l_i):
    l_b = lax.broadcast_in_dim(l_i, acc.shape, [0])
    return jnp.where(l_b > 0.0, acc / jnp.where(l_b > 0.0, l_b, 1.0), 0.0)


def check_sinks(sinks, num_q_heads: int) -> jax.Array:
    """Sink logits as the kernels take them: f32[Hq]."""
    if sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks must be f32[{num_q_heads}] (one logit per query head), got shape {sinks.shape}")
    return sinks.astype(jnp.float32)


def validate(q, k_pages, v_pages, pages_per_chunk):
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // max(num_kv_heads, 1)
    quant = isinstance(k_pages, QuantPages)
    if pages_per_chunk is None:
        pages_per_chunk = default_pages_per_chunk(head_dim, block_size, quant)
    if quant and (k_pages.dtype not in KV_QUANT_DTYPES.values() or v_pages.dtype != k_pages.dtype):
        raise ValueError(f"quantized pages must be int8 or fp8, both alike, not {k_pages.dtype}/{v_pages.dtype}")
    reason = unsupported(q.dtype, head_dim, group, block_size, pages_per_chunk,
                         kv_dtype=k_pages.dtype if quant else None)
    if reason:
        raise ValueError(reason)
    if not quant and (k_pages.dtype != q.dtype or v_pages.dtype != q.dtype):
        raise ValueError("q, k_pages and v_pages must share a dtype")
    return group, pages_per_chunk


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D] bf16/f16
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1]
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_chunk: int | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Any batch (prefill, chunked, mixed, decode): one CTA per (tile of 64 q rows, kv head).
    ``sinks``: f32[Hq] sink logits (``with_sinks``), or None (no sink term, nothing traced)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group, pages_per_chunk = validate(q, k_pages, v_pages, pages_per_chunk)
    block_q = ROWS // group  # tokens per tile; rows past block_q * G are padding
    common.check_static(
        q, k_pages, v_pages, block_tables, block_q=block_q, pages_per_chunk=pages_per_chunk
    )
    dtype = q.dtype
    chunk = pages_per_chunk * block_size
    num_seqs_max, max_blocks = block_tables.shape
    num_tiles = pl.cdiv(num_tokens, block_q)
    ops = Ops(interpret)

    q_rows = common.to_rows(q, num_kv_heads, block_q, ROWS)  # [Hkv, num_tiles*64, D]
    tile_lo, tile_hi = common.tile_seq_ranges(query_start_loc, num_seqs, num_tiles, block_q)
    tables = block_tables.astype(jnp.int32).reshape(num_seqs_max * max_blocks)

    (k_data, v_data), scales = page_arrays(k_pages, v_pages)
    sink_args = () if sinks is None else (check_sinks(sinks, num_q_heads),)

    def body(seq_lens_g, qsl_g, tables_g, lo_g, hi_g, q_g, k_g, v_g, *rest):
        *scales_g, o_g, scoped = rest
        if sinks is not None:
            *scales_g, sinks_g = scales_g
        q_smem, q_bar = scoped[0], scoped[3]
        tile = lax.axis_index("tile")
        head = lax.axis_index("head")
        tile_start = tile * block_q

        plgpu.copy_gmem_to_smem(q_g.at[head, pl.ds(tile * ROWS, ROWS)], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        row = ops.iota((ROWS, chunk), 0)
        # Rows past block_q * G pad the tile to 64: out of every sequence.
        row_tok = jnp.where(row < block_q * group, tile_start + lax.div(row, jnp.int32(group)), -1)
        col = ops.iota((ROWS, chunk), 1)
        copy = page_fetcher(scoped, k_g, v_g, head, block_size, scales_g)

        def seq_body(seq, carry):
            q_start = qsl_g[seq]
            q_end = qsl_g[seq + 1]
            kv_len = seq_lens_g[seq]
            ctx_before = kv_len - (q_end - q_start)
            t_first = jnp.maximum(q_start, tile_start)
            t_last = jnp.minimum(q_end, tile_start + block_q) - 1
            kv_end = ctx_before + (t_last - q_start) + 1
            kv_begin = jnp.int32(0)
            if sliding_window is not None:
                kv_begin = jnp.maximum(ctx_before + (t_first - q_start) - sliding_window + 1, 0)
            num_pages = lax.div(kv_end + (block_size - 1), jnp.int32(block_size))
            c_lo = lax.div(kv_begin, jnp.int32(chunk))
            c_hi = jnp.where(
                t_last >= t_first, lax.div(kv_end + (chunk - 1), jnp.int32(chunk)), c_lo
            )
            in_seq = (row_tok >= q_start) & (row_tok < q_end)
            row_pos = ctx_before + row_tok - q_start

            def fetch(c, slot):
                # Past the context, re-fetch the last real page (never the null block).
                copy(slot, [
                    tables_g[seq * max_blocks
                             + jnp.minimum(c * pages_per_chunk + j, num_pages - 1)]
                    for j in range(pages_per_chunk)
                ])

            def mask_of(c):
                kv_pos = c * chunk + col
                mask = in_seq & (kv_pos <= row_pos) & (kv_pos < kv_end)
                if sliding_window is not None:
                    mask &= kv_pos > row_pos - sliding_window
                return mask

            return stream_chunks(ops, scoped, fetch=fetch, mask_of=mask_of, c_lo=c_lo, c_hi=c_hi,
                           carry=carry, sm_scale=sm_scale, soft_cap=soft_cap, dtype=dtype, head=head)

        carry = lax.fori_loop(lo_g[tile], hi_g[tile], seq_body, ops.init_carry(head_dim))
        if sinks is not None:
            carry = with_sinks(ops, sinks_g, head, group, carry)
        acc, _, l_i = carry
        q_smem[...] = normalized(acc, l_i).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_g.at[head, pl.ds(tile * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    def rpa_general(*refs):  # named: the kernel's name in ptxas' report and profiles
        return pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            *scratch(head_dim, chunk, pages_per_chunk, dtype,
                     num_stages(head_dim, chunk, dtype, kv_dtype=k_data.dtype, block_size=block_size),
                     k_data.dtype),
        )

    kernel = plgpu.kernel(
        rpa_general,
        out_type=jax.ShapeDtypeStruct(q_rows.shape, dtype),
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "head"),
        compiler_params=compat.gpu_compiler_params(approx_math=True),
        interpret=compat.gpu_interpret_params() if interpret else None,
    )
    out = kernel(
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        tables,
        tile_lo,
        tile_hi,
        q_rows,
        k_data,
        v_data,
        *scales,
        *sink_args,
    )
    return common.from_rows(out, num_tokens, num_q_heads, block_q)
