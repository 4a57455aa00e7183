"""Ragged paged attention for TPU (Pallas / Mosaic TPU) over the fused ``tpu-fused`` KV layout.

Layout (one array per layer, ``fused_shape``): ``[num_blocks, 2 * Hkv, block_size, Dp]``; row
``2h`` of a page is kv head h's K, row ``2h + 1`` its V, ``Dp`` the head dim padded to 128 lanes.
One page of every kv head's K and V is one contiguous run of HBM, so one DMA fetches it, and
each head's K (or V) lands in VMEM as a dense ``[tokens, Dp]`` tile for the MXU. The minor two
dims ``(block_size, Dp)`` are what the TPU tiles, so the block size must be a multiple of the
dtype's sublane packing (8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit: ``sublanes``) and nothing
but the head-dim lanes is padded; a ``[.., block_size, 2 * Hkv, D]`` layout would pad 2 * Hkv up
to the packing instead (8x the memory at one kv head per device under tensor parallelism).
Interleaving K and V per head keeps a device's kv heads contiguous when the "model" mesh axis
shards dim 1. ``memory`` counts these padded bytes, so the logical KV budget is the physical one.

Grid ``(num_q_tiles,)``, run in order (``arbitrary``); each program owns ``block_q`` tokens for
every kv head (``block_q * G`` q rows per head, see ``common``). For each sequence overlapping the
tile it walks only the KV positions its rows can see (causal upper bound, sliding-window lower
bound) in chunks of ``pages_per_chunk`` pages through two VMEM slots: while chunk c is on the MXU
the DMAs of the next chunk are in flight, and the next chunk of the last one of a sequence is the
next sequence's first, in this tile or the next program's (the slot counter and an in-flight
flag persist in SMEM across grid steps): decode (one sequence per program) streams pages without
a bubble between sequences. Lengths, tile ranges and block tables are scalar-prefetched into
SMEM (a DMA of a few table ids out of HBM would be a sub-tile slice, which Mosaic rejects); tables
over ``TABLE_SMEM_BYTES`` (a 128k ``max_model_len`` x many sequences) split the batch's sequences
over several calls (``table_rows``). ``vmem_estimate``/``smem_estimate`` bound each call, and the
call's ``vmem_limit_bytes`` comes from the first (``tpu_budget``).
Online softmax in f32, per head. Block sizes are static (``block_sizes``).

Quantized pages (``--kv-cache-dtype int8|fp8_*``, ``kv_quant.QuantPages``): the data is int8/fp8
in the same fused shape (so the block size is a multiple of 32, the 8-bit sublane packing) and the
scales are f32 ``[num_blocks, 2 * Hkv, block_size]`` (``fused_scale_shape``): row ``2h`` K's and
``2h + 1`` V's, one lane per token, so one page's scales are one full ``(2 * Hkv, block_size)``
tile (HBM pads it to (8, 128): ``scale_page_bytes``). Each page's scales are DMAed with its data,
on the same semaphore and slot, into ``[2, pages_per_chunk, 2 * Hkv, block_size]`` (a whole tile
per page: no lane offset). Per chunk one exact (HIGHEST) 0/1 selection matmul per page lays them out
as ``[2 * Hkv, chunk]`` lanes; the tile is widened to the compute dtype (exact for int8 and both
fp8s), the K scales (times ``sm_scale``) multiply the score columns and the V scales the
probabilities: nothing multiplies the tile element by element.

Attention sinks (gpt-oss, ``sinks`` f32[Hq]): each q row's sink logit, laid out like the rows
([Hkv, rows, 1], the same block for every tile), joins the row's softmax sum after its last
chunk. The layout helpers are in ``tpu_layout``, block sizes and the VMEM/SMEM estimates in
``tpu_plan`` (re-exported here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, compat, tpu_budget
from pallas_kernels.kv_quant import QuantPages
from pallas_kernels.tpu_layout import (LANES, fuse_pages, fused_scale_shape, fused_shape, scale_page_bytes,
                                       sublanes, unfuse_pages)
from pallas_kernels.tpu_plan import (CHUNK_VMEM_BYTES, TABLE_SMEM_BYTES, block_sizes, smem_estimate, table_rows,
                                     vmem_estimate)

# The layout and planning names, re-exported: callers know them as tpu.<name>.
__all__ = ["CHUNK_VMEM_BYTES", "LANES", "TABLE_SMEM_BYTES", "block_sizes", "fuse_pages", "fused_scale_shape",
           "fused_shape", "ragged_paged_attention", "scale_page_bytes", "smem_estimate", "sublanes",
           "table_rows", "unfuse_pages", "vmem_estimate"]

def _cdiv(a, b: int):
    """Ceil-divide for non-negative ints (truncating division: no sign op, which Mosaic
    lowers by querying the TPU generation)."""
    return lax.div(a + (b - 1), b)


def _kernel(*refs, quantized: bool, has_sinks: bool, **static):
    """Unpack the refs, then run the body.

    Scalar prefetch (SMEM): seq_lens i32[S], qsl i32[S+1], this call's block tables
    i32[rows * max_blocks] (sequences [seq_base, seq_base + rows)), tile_lo/tile_hi i32[num_tiles].
    Inputs: q [Hkv, rows, Dp] (VMEM block), the fused pages (HBM), [quantized: their scales (HBM,
    f32[nb, 2 * Hkv, bs])], [has_sinks: each row's sink logit f32[Hkv, rows, 1] (VMEM)]. Output:
    [Hkv, rows, Dp]. Scratch: chunk buffer [2, 2 * Hkv, chunk, Dp], DMA sems [2], m/l
    f32[Hkv, rows, 1], acc f32[Hkv, rows, Dp], state i32[2] (SMEM: chunks
    issued, next chunk in flight), [quantized: the scales' chunk buffer f32[2, ppc, 2 * Hkv, bs]].
    """
    if quantized:
        *refs, scale_buf = refs
    (seq_lens_ref, qsl_ref, tables_ref, lo_ref, hi_ref, q_ref, kv_hbm, *refs) = refs
    scales = (refs.pop(0), scale_buf) if quantized else None
    sinks = refs.pop(0) if has_sinks else None
    o_ref, *scratch = refs
    _body(seq_lens_ref, qsl_ref, lo_ref, hi_ref, q_ref, kv_hbm, o_ref, *scratch,
          tables=tables_ref, scales=scales, sinks=sinks, **static)


def _body(
    seq_lens_ref, qsl_ref, tile_lo_ref, tile_hi_ref, q_ref, kv_hbm, o_ref,
    buf, sems, m_ref, l_ref, acc_ref, state,
    *,
    tables,
    scales: tuple | None,
    sinks,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    group: int,
    block_size: int,
    pages_per_chunk: int,
    max_blocks: int,
    num_tiles: int,
    seq_base: int,
):
    tile = pl.program_id(0)
    num_kv_heads, rows, _ = m_ref.shape
    chunk = pages_per_chunk * block_size

    @pl.when(tile == 0)
    def _():
        state[0] = 0  # chunks issued so far: chunk n uses slot n % 2
        state[1] = 0  # 1: the next sequence's first chunk is already in flight

    m_ref[...] = jnp.full_like(m_ref, common.MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def bounds(t, seq):
        """What tile t's rows need of sequence seq: (c_lo, c_hi, num_pages, kv_end, ...)."""
        q_start, q_end = qsl_ref[seq], qsl_ref[seq + 1]
        ctx_before = seq_lens_ref[seq] - (q_end - q_start)  # position of its first new token
        t_first = jnp.maximum(q_start, t * block_q)
        t_last = jnp.minimum(q_end, t * block_q + block_q) - 1
        kv_end = ctx_before + (t_last - q_start) + 1  # exclusive; <= kv_len
        kv_begin = jnp.int32(0)
        if sliding_window is not None:
            kv_begin = jnp.maximum(ctx_before + (t_first - q_start) - sliding_window + 1, 0)
        c_lo = lax.div(kv_begin, chunk)
        c_hi = jnp.where(t_last >= t_first, _cdiv(kv_end, chunk), c_lo)
        return c_lo, c_hi, _cdiv(kv_end, block_size), kv_end, ctx_before, q_start, q_end

    def block_id(seq, c, j):
        page_idx = jnp.minimum(c * pages_per_chunk + j, max_blocks - 1)
        return tables[(seq - seq_base) * max_blocks + page_idx]

    def page_copies(seq, c, slot, num_pages):
        """One DMA per page of chunk c: K and V of all its kv heads (and, quantized, a second one
        of their scales, on the same semaphore); pages past the sequence's visible end are
        skipped."""
        copies = []
        for j in range(pages_per_chunk):
            needed, block = c * pages_per_chunk + j < num_pages, block_id(seq, c, j)
            copies.append((needed, pltpu.make_async_copy(
                kv_hbm.at[block], buf.at[slot, :, pl.ds(j * block_size, block_size)], sems.at[slot])))
            if scales is not None:
                copies.append((needed, pltpu.make_async_copy(
                    scales[0].at[block], scales[1].at[slot, j], sems.at[slot])))
        return copies

    def chunk_scales(c, slot, num_pages):
        """Quantized: chunk c's scales as f32[2 * Hkv, chunk] (one lane per KV position). Page j's
        [2 * Hkv, bs] tile goes to lanes [j * bs, (j + 1) * bs) by an exact 0/1 selection matmul
        (a lane shift Mosaic cannot do as a copy at bs < 128); pages not fetched are zeroed first,
        as stale VMEM times 0 would still be NaN."""
        sel = (lax.broadcasted_iota(jnp.int32, (block_size, chunk), 1)  # KV position - token in page
               - lax.broadcasted_iota(jnp.int32, (block_size, chunk), 0))
        out = None
        for j in range(pages_per_chunk):
            tile = jnp.where(c * pages_per_chunk + j < num_pages, scales[1][slot, j], 0.0)
            part = lax.dot_general(tile, (sel == j * block_size).astype(jnp.float32),
                                   (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
            out = part if out is None else out + part
        return out

    def fetch(seq, c, slot, num_pages):
        for needed, cp in page_copies(seq, c, slot, num_pages):
            pl.when(needed)(cp.start)

    def prefetch_next(seq, slot, when):
        """When ``when``, start the first chunk of the sequence after seq (in this tile, else the
        first of the next tile); 1 when something was started."""
        in_tile = seq + 1 < tile_hi_ref[tile]
        next_tile = jnp.where(in_tile, tile, jnp.minimum(tile + 1, num_tiles - 1))
        next_seq = jnp.where(in_tile, seq + 1, tile_lo_ref[next_tile])
        exists = in_tile | ((tile + 1 < num_tiles) & (next_seq < tile_hi_ref[next_tile]))
        c_lo, c_hi, num_pages, *_ = bounds(next_tile, next_seq)
        go = when & exists & (c_lo < c_hi)

        @pl.when(go)
        def _():
            fetch(next_seq, c_lo, slot, num_pages)

        return go.astype(jnp.int32)

    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    # Rows past block_q * G pad the tile to the sublane multiple: mark them out of every sequence.
    row_tok = jnp.where(row < block_q * group, tile * block_q + lax.div(row, group), -1)

    def seq_body(seq, carry):
        issued, pending = carry
        c_lo, c_hi, num_pages, kv_end, ctx_before, q_start, q_end = bounds(tile, seq)
        in_seq = (row_tok >= q_start) & (row_tok < q_end)
        row_pos = ctx_before + row_tok - q_start

        @pl.when((c_lo < c_hi) & (pending == 0))
        def _():
            fetch(seq, c_lo, lax.rem(issued, 2), num_pages)

        def chunk_body(c, carry):
            issued, pending = carry
            slot = lax.rem(issued, 2)

            @pl.when(c + 1 < c_hi)
            def _():
                fetch(seq, c + 1, 1 - slot, num_pages)

            pending = prefetch_next(seq, 1 - slot, c + 1 == c_hi)
            for needed, cp in page_copies(seq, c, slot, num_pages):
                pl.when(needed)(cp.wait)
            kv_pos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            mask = in_seq & (kv_pos <= row_pos) & (kv_pos < kv_end)
            if sliding_window is not None:
                mask &= kv_pos > row_pos - sliding_window
            # Pages past kv_end were not fetched this round: zero them so stale VMEM
            # (possibly NaN) never reaches the accumulator through 0 * NaN.
            kv_col = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
            if scales is not None:
                scale = chunk_scales(c, slot, num_pages)
                # stale positions past kv_end (masked in p anyway) must not turn p * s_v into NaN
                scale = jnp.where(kv_pos < kv_end, scale, 0.0)
            compute = q_ref.dtype
            for h in range(num_kv_heads):  # static: each head's dense [chunk, Dp] K and V tiles
                k = buf[slot, 2 * h]
                if scales is not None:
                    k = k.astype(compute)  # exact: int8 and both fp8s fit bf16/f16/f32
                s = lax.dot_general(
                    q_ref[h], k, (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                # the K scales multiply the score columns (one per KV position)
                s = s * (scale[2 * h:2 * h + 1] * sm_scale) if scales is not None else s * sm_scale
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, common.MASK_VALUE)
                m_prev = m_ref[h]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
                alpha = jnp.exp(m_prev - m_new)
                v = buf[slot, 2 * h + 1]
                pw = p
                if scales is not None:
                    v = v.astype(compute)
                    pw = p * scale[2 * h + 1:2 * h + 2]  # the V scales multiply the probabilities
                v = jnp.where(kv_col < kv_end, v, jnp.zeros_like(v))
                pv = lax.dot_general(
                    pw.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                m_ref[h] = m_new
                l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
                acc_ref[h] = alpha * acc_ref[h] + pv
            return issued + 1, pending

        return lax.fori_loop(c_lo, c_hi, chunk_body, (issued, pending))

    issued, pending = lax.fori_loop(
        tile_lo_ref[tile], tile_hi_ref[tile], seq_body, (state[0], state[1])
    )
    state[0] = issued
    state[1] = pending

    l, acc = l_ref[...], acc_ref[...]
    if sinks is not None:  # each row's sink logit joins the sum (relative to the larger max), no value
        sink, m = sinks[...], m_ref[...]
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.exp(sink - m_new)
        acc = acc * alpha
    safe_l = jnp.where(l > 0.0, l, 1.0)
    o_ref[...] = jnp.where(l > 0.0, acc / safe_l, 0.0).astype(o_ref.dtype)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages,  # fused [num_blocks, 2 * Hkv, block_size, Dp], or K [nb, bs, Hkv, D]; or QuantPages
    v_pages,  # None (fused), or V [nb, bs, Hkv, D] (fused here first)
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1]
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int = 8,
    pages_per_chunk: int = 8,
    table_smem_bytes: int = TABLE_SMEM_BYTES,
    sinks: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """``table_smem_bytes``: block tables live in SMEM, at most this many bytes per kernel call;
    a batch whose tables are larger (long ``max_model_len`` x many sequences) is split by
    sequences over several calls (``table_rows``), each walking only its own sequences, and the
    outputs are summed (each token's row is non-zero in exactly one call). Quantized pages
    (``QuantPages``, fused data + f32[nb, 2 * Hkv, bs] scales) compute in q's dtype. The call
    asks for ``tpu_budget.vmem_limit(vmem_estimate(...))`` of VMEM. ``sinks``: f32[Hq] sink
    logits (gpt-oss), laid out per q row like q ([Hkv, rows, 1], one VMEM block for every tile)
    and taken into each row's softmax sum at the end; None: no sink term, nothing traced."""
    kv = k_pages if v_pages is None else fuse_pages(k_pages, v_pages)
    quantized = isinstance(kv, QuantPages)
    kv, kv_scale = (kv.data, kv.scale) if quantized else (kv, None)
    num_tokens, num_q_heads, head_dim = q.shape
    _, kv_rows, block_size, padded_dim = kv.shape
    num_kv_heads = kv_rows // 2
    if kv.shape != fused_shape(kv.shape[0], block_size, num_kv_heads, head_dim, kv.dtype):
        raise ValueError(f"pages {kv.shape} are not the tpu-fused layout of head_dim {head_dim}")
    if quantized and kv_scale.shape != fused_scale_shape(kv.shape[0], block_size, kv_rows // 2):
        raise ValueError(f"scales {kv_scale.shape} do not match quantized tpu-fused pages {kv.shape}")
    if num_q_heads % num_kv_heads or block_q < 1 or pages_per_chunk < 1:
        raise ValueError(f"bad shapes: Hq={num_q_heads} Hkv={num_kv_heads} {block_q=} "
                         f"{pages_per_chunk=}")
    group = num_q_heads // num_kv_heads
    num_seqs_max, max_blocks = block_tables.shape
    num_tiles = pl.cdiv(num_tokens, block_q)
    rows = common.round_up(block_q * group, sublanes(q.dtype))  # padding rows are masked
    chunk = pages_per_chunk * block_size

    q_rows = common.to_rows(q, num_kv_heads, block_q, rows)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_dim - head_dim)))
    tile_lo, tile_hi = common.tile_seq_ranges(query_start_loc, num_seqs, num_tiles, block_q)

    sink_rows = ()
    if sinks is not None:
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"sinks must be f32[{num_q_heads}] (one logit per query head), got shape {sinks.shape}")
        # row r of a tile of kv head h is query head h * G + r % G (padding rows: any value)
        per_row = sinks.astype(jnp.float32).reshape(num_kv_heads, group)[:, jnp.arange(rows) % group]
        sink_rows = (per_row[..., None],)
    kernel = functools.partial(
        _kernel, quantized=quantized, has_sinks=sinks is not None, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, block_q=block_q, group=group, block_size=block_size,
        pages_per_chunk=pages_per_chunk, max_blocks=max_blocks, num_tiles=num_tiles,
    )
    hbm = pl.BlockSpec(memory_space=compat.tpu_hbm())
    row_spec = pl.BlockSpec((num_kv_heads, rows, padded_dim), lambda i, *_: (0, i, 0))
    scratch = [
        pltpu.VMEM((2, kv_rows, chunk, padded_dim), kv.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, padded_dim), jnp.float32),
        pltpu.SMEM((2,), jnp.int32),
    ]
    if quantized:  # each page's scales: one whole (2 * Hkv, bs) tile per chunk slot and page
        scratch.append(pltpu.VMEM((2, pages_per_chunk, kv_rows, block_size), jnp.float32))
    estimate = vmem_estimate(num_kv_heads=num_kv_heads, rows=rows, head_dim=head_dim, q_dtype=q.dtype,
                             kv_dtype=kv.dtype, block_size=block_size, pages_per_chunk=pages_per_chunk,
                             quantized=quantized, sinks=sinks is not None)
    pages = (kv, kv_scale) if quantized else (kv,)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_tiles,),
        in_specs=[row_spec, *[hbm] * len(pages),
                  *[pl.BlockSpec((num_kv_heads, rows, 1), lambda i, *_: (0, 0, 0))] * len(sink_rows)],
        out_specs=row_spec,
        scratch_shapes=scratch,
    )
    lens = (seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32))
    tables = block_tables.astype(jnp.int32)
    per_call = table_rows(num_seqs_max, max_blocks, table_smem_bytes)
    out = None
    for base in range(0, num_seqs_max, per_call):
        part = tables[base:base + per_call]
        part = jnp.pad(part, ((0, per_call - part.shape[0]), (0, 0))).reshape(-1)
        lo = jnp.clip(tile_lo, base, base + per_call)
        hi = jnp.maximum(jnp.clip(tile_hi, base, base + per_call), lo)
        call = pl.pallas_call(
            functools.partial(kernel, seq_base=base),
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
            # In order: a program's last DMAs fetch the next program's first pages.
            compiler_params=compat.tpu_compiler_params(
                dimension_semantics=("arbitrary",), vmem_limit_bytes=tpu_budget.vmem_limit(estimate)),
            interpret=compat.tpu_interpret_params() if interpret else False,
            name="ragged_paged_attention_tpu",
        )(*lens, part, lo, hi, q_rows, *pages, *sink_rows)
        out = call if out is None else out + call  # a token's row is non-zero in one call only
    return common.from_rows(out[..., :head_dim], num_tokens, num_q_heads, block_q)
