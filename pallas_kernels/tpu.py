"""Ragged paged attention for TPU (Pallas / Mosaic TPU).

Grid ``(num_q_tiles,)``; each program owns one tile of ``block_q`` tokens for every kv head
(``block_q * G`` q rows per head, see ``common``), so one DMA per page brings all its kv heads
(a contiguous ``[block_size, Hkv, D]`` run of HBM instead of Hkv strided ones). Block tables, lengths and the per-tile sequence ranges
are scalar-prefetched into SMEM, so page addresses are known before the body runs (block tables
too up to ``TABLE_SMEM_BYTES``; longer ones stay in HBM and each chunk DMAs its few ids into a
two-slot SMEM buffer, so a 128k-token ``max_model_len`` fits). For each
sequence overlapping the tile the body walks only the KV positions that tile's rows can see
(causal upper bound, sliding-window lower bound) in chunks of ``pages_per_chunk`` pages, with
two VMEM buffers: while chunk c is on the MXU, the DMAs for chunk c+1 (one per page and K/V,
straight from the paged HBM cache) are in flight. Online softmax in f32, per head.

Block sizes are static keyword arguments; nothing is read from the device at trace time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.runtime import compat
from pallas_kernels import common

# SMEM is about 1 MiB per core (less on older chips), shared with the other scalar operands.
TABLE_SMEM_BYTES = 256 * 1024


def block_sizes(decode_only: bool, group: int, block_size: int) -> dict[str, int]:
    """The one table of TPU block sizes, by step kind (a static property of the bucket).

    Decode: one token (one sequence) per program, so each sequence's pages stream once with
    only its own G rows on the MXU, and 256-token chunks. Prefill/mixed: about 128 q rows per
    tile (MXU-shaped) and 128-token chunks.
    """
    if decode_only:
        return {"block_q": 1, "pages_per_chunk": max(1, 256 // block_size)}
    return {"block_q": max(1, 128 // group), "pages_per_chunk": max(1, 128 // block_size)}


def _cdiv(a, b: int):
    """Ceil-divide for non-negative ints (truncating division: no sign op, which Mosaic
    lowers by querying the TPU generation)."""
    return lax.div(a + (b - 1), b)


def _kernel(*refs, tables_in_smem: bool, **static):
    """Unpack the refs of either table mode, then run the body.

    Scalar prefetch (SMEM): seq_lens i32[S], qsl i32[S+1], [tables i32[S * max_blocks] when they
    fit], tile_lo/tile_hi i32[num_tiles]. Inputs: q [Hkv, rows, D] (VMEM block), k/v pages
    (HBM), [tables in HBM otherwise]. Output: [Hkv, rows, D]. Scratch: k/v chunk buffers
    [2, chunk, Hkv, D], DMA sems [2, 2], m/l f32[Hkv, rows, 1], acc f32[Hkv, rows, D], [the
    chunk's table entries i32[2 * ppc] in
    SMEM and their DMA semaphore when the tables stay in HBM as i32[S, max_blocks + ppc]].
    """
    if tables_in_smem:
        (seq_lens_ref, qsl_ref, tables_ref, lo_ref, hi_ref, q_ref, k_hbm, v_hbm, o_ref,
         *scratch) = refs
        tables = (tables_ref,)
    else:
        (seq_lens_ref, qsl_ref, lo_ref, hi_ref, q_ref, k_hbm, v_hbm, tables_hbm, o_ref,
         *scratch) = refs
        tables = (tables_hbm, *scratch[6:])
    _body(seq_lens_ref, qsl_ref, lo_ref, hi_ref, q_ref, k_hbm, v_hbm, o_ref, *scratch[:6],
          tables=tables, **static)


def _body(
    seq_lens_ref, qsl_ref, tile_lo_ref, tile_hi_ref, q_ref, k_hbm, v_hbm, o_ref,
    k_buf, v_buf, sems, m_ref, l_ref, acc_ref,
    *,
    tables: tuple,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    group: int,
    block_size: int,
    pages_per_chunk: int,
    max_blocks: int,
):
    tile = pl.program_id(0)
    num_kv_heads, rows, _ = m_ref.shape
    chunk = pages_per_chunk * block_size

    m_ref[...] = jnp.full_like(m_ref, common.MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

    tile_start = tile * block_q
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    # Rows past block_q * G pad the tile to the sublane multiple: mark them out of every sequence.
    row_tok = jnp.where(row < block_q * group, tile_start + lax.div(row, group), -1)

    def load_table(seq, c, slot):
        """HBM-table mode: this chunk's block ids into SMEM slot ``slot`` (a few bytes; each
        row of the table is padded by one chunk, so the slice never runs off its end)."""
        if len(tables) == 1:
            return
        tables_hbm, ids, sem = tables
        cp = pltpu.make_async_copy(
            tables_hbm.at[seq, pl.ds(c * pages_per_chunk, pages_per_chunk)],
            ids.at[pl.ds(slot * pages_per_chunk, pages_per_chunk)],
            sem.at[0],
        )
        cp.start()
        cp.wait()

    def block_id(seq, c, j, slot):
        if len(tables) == 1:
            page_idx = jnp.minimum(c * pages_per_chunk + j, max_blocks - 1)
            return tables[0][seq * max_blocks + page_idx]
        return tables[1][slot * pages_per_chunk + j]

    def page_copies(seq, c, slot, num_pages):
        """One async copy per (K|V, page) of chunk c, all kv heads of the page at once (a
        contiguous [block_size, Hkv, D] run of HBM); pages past the sequence are skipped."""
        copies = []
        for j in range(pages_per_chunk):
            page_idx = c * pages_per_chunk + j
            needed = page_idx < num_pages
            block = block_id(seq, c, j, slot)
            for kv, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                copies.append(
                    (
                        needed,
                        pltpu.make_async_copy(
                            src.at[block],
                            buf.at[slot, pl.ds(j * block_size, block_size)],
                            sems.at[kv, slot],
                        ),
                    )
                )
        return copies

    def start(copies):
        for needed, cp in copies:
            pl.when(needed)(cp.start)

    def wait(copies):
        for needed, cp in copies:
            pl.when(needed)(cp.wait)

    def seq_body(seq, carry):
        q_start = qsl_ref[seq]
        q_end = qsl_ref[seq + 1]
        kv_len = seq_lens_ref[seq]
        ctx_before = kv_len - (q_end - q_start)  # position of this sequence's first new token
        t_first = jnp.maximum(q_start, tile_start)
        t_last = jnp.minimum(q_end, tile_start + block_q) - 1
        kv_end = ctx_before + (t_last - q_start) + 1  # exclusive; <= kv_len
        kv_begin = jnp.int32(0)
        if sliding_window is not None:
            kv_begin = jnp.maximum(ctx_before + (t_first - q_start) - sliding_window + 1, 0)
        num_pages = _cdiv(kv_end, block_size)
        c_lo = lax.div(kv_begin, chunk)
        c_hi = jnp.where(t_last >= t_first, _cdiv(kv_end, chunk), c_lo)

        in_seq = (row_tok >= q_start) & (row_tok < q_end)
        row_pos = ctx_before + row_tok - q_start

        @pl.when(c_lo < c_hi)
        def _():
            load_table(seq, c_lo, 0)
            start(page_copies(seq, c_lo, 0, num_pages))

        def chunk_body(c, carry):
            slot = lax.rem(c - c_lo, 2)

            @pl.when(c + 1 < c_hi)
            def _():
                load_table(seq, c + 1, 1 - slot)
                start(page_copies(seq, c + 1, 1 - slot, num_pages))

            wait(page_copies(seq, c, slot, num_pages))
            kv_pos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            mask = in_seq & (kv_pos <= row_pos) & (kv_pos < kv_end)
            if sliding_window is not None:
                mask &= kv_pos > row_pos - sliding_window
            # Pages past kv_end were not fetched this round: zero them so stale VMEM
            # (possibly NaN) never reaches the accumulator through 0 * NaN.
            kv_col = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
            for h in range(num_kv_heads):  # static: each head's [chunk, D] slice of the pages
                s = lax.dot_general(
                    q_ref[h], k_buf[slot, :, h, :], (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                ) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, common.MASK_VALUE)
                m_prev = m_ref[h]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
                alpha = jnp.exp(m_prev - m_new)
                v = v_buf[slot, :, h, :]
                v = jnp.where(kv_col < kv_end, v, jnp.zeros_like(v))
                pv = lax.dot_general(
                    p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                m_ref[h] = m_new
                l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
                acc_ref[h] = alpha * acc_ref[h] + pv
            return carry

        return lax.fori_loop(c_lo, c_hi, chunk_body, carry)

    lax.fori_loop(tile_lo_ref[tile], tile_hi_ref[tile], seq_body, 0)

    l = l_ref[...]
    safe_l = jnp.where(l > 0.0, l, 1.0)
    o_ref[...] = jnp.where(l > 0.0, acc_ref[...] / safe_l, 0.0).astype(o_ref.dtype)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
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
    block_q: int = 8,
    pages_per_chunk: int = 8,
    table_smem_bytes: int = TABLE_SMEM_BYTES,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """``table_smem_bytes``: block tables up to this size are scalar-prefetched into SMEM;
    larger ones (long ``max_model_len`` x many sequences) stay in HBM and each chunk DMAs its
    ``pages_per_chunk`` ids into a two-slot SMEM buffer, so SMEM use is bounded."""
    common.check_static(
        q, k_pages, v_pages, block_tables, block_q=block_q, pages_per_chunk=pages_per_chunk
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    num_seqs_max, max_blocks = block_tables.shape
    num_tiles = pl.cdiv(num_tokens, block_q)
    # Sublane multiple: 8 rows of 32-bit, 16 of 16-bit values; padding rows are masked.
    rows = common.round_up(block_q * group, 8 * 4 // jnp.dtype(q.dtype).itemsize)
    chunk = pages_per_chunk * block_size

    q_rows = common.to_rows(q, num_kv_heads, block_q, rows)
    tile_lo, tile_hi = common.tile_seq_ranges(query_start_loc, num_seqs, num_tiles, block_q)

    tables = block_tables.astype(jnp.int32).reshape(num_seqs_max * max_blocks)
    tables_in_smem = tables.size * 4 <= table_smem_bytes
    kernel = functools.partial(
        _kernel,
        tables_in_smem=tables_in_smem,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=block_q,
        group=group,
        block_size=block_size,
        pages_per_chunk=pages_per_chunk,
        max_blocks=max_blocks,
    )
    hbm = pl.BlockSpec(memory_space=compat.tpu_hbm())
    row_spec = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    scratch = [
        pltpu.VMEM((2, chunk, num_kv_heads, head_dim), k_pages.dtype),
        pltpu.VMEM((2, chunk, num_kv_heads, head_dim), v_pages.dtype),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
    ]
    lens = (seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32))
    if tables_in_smem:
        prefetch, inputs = (*lens, tables, tile_lo, tile_hi), (q_rows, k_pages, v_pages)
        in_specs = [row_spec, hbm, hbm]
    else:
        prefetch = (*lens, tile_lo, tile_hi)
        padded = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_chunk)))
        inputs = (q_rows, k_pages, v_pages, padded)  # [S, max_blocks + ppc], stays in HBM
        in_specs = [row_spec, hbm, hbm, hbm]
        scratch += [pltpu.SMEM((2 * pages_per_chunk,), jnp.int32), pltpu.SemaphoreType.DMA((1,))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(num_tiles,),
        in_specs=in_specs,
        out_specs=row_spec,
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=("parallel",),
        ),
        interpret=compat.tpu_interpret_params() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(*prefetch, *inputs)
    return common.from_rows(out, num_tokens, num_q_heads, block_q)
