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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels import common
from pallas_kernels.kv_quant import KV_QUANT_DTYPES, QuantPages

ROWS = 64  # WGMMA M per warpgroup
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 80, 96, 128, 256)
# Hopper's per-block shared memory limit is 227 KiB (opt-in maximum); keep 8 KiB for the
# compiler's own scratch (cross-warp reductions, layout changes).
SMEM_BYTES = 219 * 1024
MAX_STAGES = 4  # chunks of K/V in flight at most (a ring of TMA destinations)
# KV tokens per chunk by head_dim: bounded by the f32 scores [64, chunk] held in registers and
# by two ring slots of K and V (2 x 2 x chunk x D x 2 bytes) fitting beside the q/out tile.
CHUNK_TOKENS = {64: 128, 80: 128, 96: 128, 128: 128, 256: 64}


def swizzle_bytes(head_dim: int, dtype) -> int:
    """The widest SMEM swizzle (128/64/32 bytes) that divides a row of ``head_dim`` elements."""
    row = head_dim * jnp.dtype(dtype).itemsize
    return next(s for s in (128, 64, 32, 16) if row % s == 0)


def default_pages_per_chunk(head_dim: int, block_size: int) -> int:
    return max(1, CHUNK_TOKENS.get(head_dim, 64) // block_size)


def smem_bytes(head_dim: int, chunk: int, dtype, stages: int = 2, extra: int = 0, kv_dtype=None,
               block_size: int = 0) -> int:
    """q/out tile + K and V x ``stages`` ring slots + barriers + ``extra`` (a kernel's own);
    quantized pages (``kv_dtype`` int8/fp8): ring slots of that dtype, their scale slots
    (``scratch``'s [pages, 2, scale_width] f32 each) and the two widened compute-dtype tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    ring = 2 * stages * chunk * head_dim * jnp.dtype(kv_dtype or dtype).itemsize
    if kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        block_size = block_size or chunk
        scale_slot = (chunk // block_size) * 2 * scale_width(block_size) * 4
        ring += stages * scale_slot + 2 * chunk * head_dim * itemsize
    return ROWS * head_dim * itemsize + ring + 1024 + extra


def num_stages(head_dim: int, chunk: int, dtype, extra: int = 0, kv_dtype=None, block_size: int = 0) -> int:
    """The deepest TMA ring (2..MAX_STAGES chunks in flight) that fits in shared memory."""
    fits = [n for n in range(2, MAX_STAGES + 1)
            if smem_bytes(head_dim, chunk, dtype, n, extra, kv_dtype, block_size) <= SMEM_BYTES]
    return max(fits, default=2)


def unsupported(dtype, head_dim: int, group: int, block_size: int,
                pages_per_chunk: int | None = None, kv_dtype=None) -> str | None:
    """Why this kernel cannot run a shape (None when it can); decided before anything traces.
    ``kv_dtype``: the pages' dtype when they are quantized (int8 / fp8), else None."""
    if jnp.dtype(dtype) not in DTYPES:
        return (f"the Mosaic GPU kernel needs bfloat16 or float16 q/KV (WGMMA operands), got "
                f"{jnp.dtype(dtype).name}: use --dtype bfloat16")
    if head_dim not in HEAD_DIMS:
        return f"the Mosaic GPU kernel supports head_dim {HEAD_DIMS}, not {head_dim}"
    if kv_dtype is not None and (head_dim * jnp.dtype(kv_dtype).itemsize) % 32:
        # a page row of 1-byte elements must fill a 32/64/128-byte SMEM swizzle
        return (f"the Mosaic GPU kernel supports head_dim {tuple(d for d in HEAD_DIMS if d % 32 == 0)} with "
                f"{jnp.dtype(kv_dtype).name} KV, not {head_dim}")
    if not 1 <= group <= ROWS:
        return f"the Mosaic GPU kernel supports GQA ratios 1..{ROWS}, not {group}"
    if block_size % 8 or block_size > 256:
        return f"the Mosaic GPU kernel needs a block size that is a multiple of 8 up to 256, " \
               f"not {block_size}"
    ppc = pages_per_chunk or default_pages_per_chunk(head_dim, block_size)
    chunk = ppc * block_size
    if chunk % 64:
        return f"pages_per_chunk*block_size={chunk} must be a multiple of 64"
    need = smem_bytes(head_dim, chunk, dtype, kv_dtype=kv_dtype, block_size=block_size)
    if need > SMEM_BYTES:
        return (f"a chunk of {chunk} KV tokens at head_dim {head_dim} needs "
                f"{need} bytes of shared memory (> {SMEM_BYTES})")
    return None


class Ops:
    """The Mosaic GPU pieces both kernels use, with the interpreter's substitutes."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def layout_cast(self, x, layout):
        # The Mosaic GPU interpreter has no rule for layout_cast; layouts only matter when lowering.
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        return self.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)

    def mma_qk(self, q_ref, k_ref):  # [ROWS, D] x [chunk, D]^T -> f32[ROWS, chunk]
        if self.interpret:  # the interpreter's wgmma takes neither transposed refs nor register lhs
            return lax.dot_general(
                q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, q_ref, plgpu.transpose_ref(k_ref, (1, 0)))
            return acc_ref[...]

        return pl.run_scoped(scope, plgpu.ACC((ROWS, k_ref.shape[0]), jnp.float32))

    def mma_pv(self, p, v_ref):  # [ROWS, chunk] (registers) x [chunk, D] -> f32[ROWS, D]
        if self.interpret:
            return jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, p, v_ref)
            return acc_ref[...]

        # A fresh accumulator rather than ACC.init(acc) + run_state: keeps one code shape.
        return pl.run_scoped(scope, plgpu.ACC((ROWS, v_ref.shape[1]), jnp.float32))

    def widen(self, src, dst):
        """A quantized SMEM chunk -> its compute-dtype copy ``dst`` (exact), for the MMA."""
        x = src[...]
        if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating) and dst.dtype != x.dtype:
            x = x.astype(jnp.float16)  # exact; sm_90 converts fp8 to f16 only (f16 -> bf16 is exact too)
        dst[...] = x.astype(dst.dtype)
        plgpu.commit_smem()  # the MMA reads dst through the async proxy
        return dst

    def scales(self, slot_ref, kv: int, block_size: int):
        """A chunk's K (``kv`` 0) or V (1) scales from its slot [pages, 2, width]: f32[chunk] in
        the column layout of the scores (a [pages, block_size] load, pages laid end to end)."""
        pages = slot_ref.shape[0]
        # one page: a 1-D load (Mosaic folds no unit dim of a non-contiguous [1, bs] view)
        ref = slot_ref.at[0 if pages == 1 else slice(None), kv, pl.ds(0, block_size)]
        if self.interpret:
            x = ref[...]
        else:
            x = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))
        return x.reshape(pages * block_size)

    def init_carry(self, head_dim):
        acc = self.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        row = plgpu.Layout.WGMMA.reduce(1)
        m_i = self.layout_cast(jnp.full((ROWS,), common.MASK_VALUE, jnp.float32), row)
        l_i = self.layout_cast(jnp.zeros((ROWS,), jnp.float32), row)
        return acc, m_i, l_i


def smem_transforms(head_dim: int, dtype):
    swizzle = swizzle_bytes(head_dim, dtype)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def scale_width(block_size: int) -> int:
    """Floats per (page, kv head, K|V) row of the scales the kernels take: ``block_size`` padded
    to 16, so that a page's K and V scales (2 rows) are one TMA copy of a multiple of 128 bytes."""
    return common.round_up(block_size, 16)


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


def normalized(acc, l_i):
    l_b = lax.broadcast_in_dim(l_i, acc.shape, [0])
    return jnp.where(l_b > 0.0, acc / jnp.where(l_b > 0.0, l_b, 1.0), 0.0)


def validate(q, k_pages, v_pages, pages_per_chunk):
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // max(num_kv_heads, 1)
    if pages_per_chunk is None:
        pages_per_chunk = default_pages_per_chunk(head_dim, block_size)
    quant = isinstance(k_pages, QuantPages)
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
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Any batch (prefill, chunked, mixed, decode): one CTA per (tile of 64 q rows, kv head)."""
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

    def body(seq_lens_g, qsl_g, tables_g, lo_g, hi_g, q_g, k_g, v_g, *rest):
        *scales_g, o_g, scoped = rest
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

        acc, _, l_i = lax.fori_loop(lo_g[tile], hi_g[tile], seq_body, ops.init_carry(head_dim))
        q_smem[...] = normalized(acc, l_i).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_g.at[head, pl.ds(tile * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        lambda *refs: pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            *scratch(head_dim, chunk, pages_per_chunk, dtype,
                     num_stages(head_dim, chunk, dtype, kv_dtype=k_data.dtype, block_size=block_size),
                     k_data.dtype),
        ),
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
    )
    return common.from_rows(out, num_tokens, num_q_heads, block_q)
