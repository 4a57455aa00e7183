"""Shared-memory budget and launch planning of the Mosaic GPU attention kernels (``gpu``,
``gpu_decode``): which shapes run (``unsupported``), KV tokens per chunk, the depth of the TMA
ring that fits in shared memory, and the layout of quantized pages' scales. Shapes only: nothing
here traces or imports Mosaic GPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common

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
# Quantized pages in the general kernel: the widening and the scale loads need registers beside the
# f32[64, chunk] scores; at 128 tokens ptxas spilled (sm_90a, head_dim 128: 255 registers, 428 B of
# spills), at 64 none (248 registers). bench/RESULTS.md has the table per variant.
QUANT_CHUNK_TOKENS = 64


def swizzle_bytes(head_dim: int, dtype) -> int:
    """The widest SMEM swizzle (128/64/32 bytes) that divides a row of ``head_dim`` elements."""
    row = head_dim * jnp.dtype(dtype).itemsize
    return next(s for s in (128, 64, 32, 16) if row % s == 0)


def default_pages_per_chunk(head_dim: int, block_size: int, quantized: bool = False) -> int:
    tokens = CHUNK_TOKENS.get(head_dim, 64)
    return max(1, (min(tokens, QUANT_CHUNK_TOKENS) if quantized else tokens) // block_size)


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
    ppc = pages_per_chunk or default_pages_per_chunk(head_dim, block_size, kv_dtype is not None)
    chunk = ppc * block_size
    if chunk % 64:
        return f"pages_per_chunk*block_size={chunk} must be a multiple of 64"
    need = smem_bytes(head_dim, chunk, dtype, kv_dtype=kv_dtype, block_size=block_size)
    if need > SMEM_BYTES:
        return (f"a chunk of {chunk} KV tokens at head_dim {head_dim} needs "
                f"{need} bytes of shared memory (> {SMEM_BYTES})")
    return None


def scale_width(block_size: int) -> int:
    """Floats per (page, kv head, K|V) row of the scales the kernels take: ``block_size`` padded
    to 16, so that a page's K and V scales (2 rows) are one TMA copy of a multiple of 128 bytes."""
    return common.round_up(block_size, 16)
