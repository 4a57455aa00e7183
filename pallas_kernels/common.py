"""Layout helpers and validation shared by the TPU and GPU ragged paged attention kernels.

Both kernels work on "rows": q is regrouped per kv head (row = token * G + g within a tile, G =
Hq // Hkv), so one tile of ``block_q`` tokens is a dense ``[block_q * G, D]`` matrix, zero-padded
to the tile's row count, that shares one K/V stream (GQA costs no extra KV traffic). A tile may span
several sequences; the wrapper gives each tile the range of sequences it overlaps so the kernel loops
over only those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def check_static(q, k_pages, v_pages, block_tables, *, block_q: int, pages_per_chunk: int) -> None:
    """Trace-time (shape) validation; value checks are the caller's job."""
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, head_dim_k = k_pages.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and pages ({head_dim_k}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if block_q < 1 or pages_per_chunk < 1:
        raise ValueError(f"block_q={block_q} and pages_per_chunk={pages_per_chunk} must be >= 1")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {block_tables.shape}")


def to_rows(q: jax.Array, num_kv_heads: int, block_q: int, tile_rows: int) -> jax.Array:
    """[T, Hq, D] -> [Hkv, num_tiles * tile_rows, D]: per tile, ``block_q * G`` real rows then
    zero rows up to ``tile_rows`` (the MMA's M, or the TPU's sublane multiple), so any G works."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_tiles = -(-num_tokens // block_q)
    q = jnp.pad(q, ((0, num_tiles * block_q - num_tokens), (0, 0), (0, 0)))
    q = q.reshape(num_tiles, block_q, num_kv_heads, group, head_dim).transpose(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads, num_tiles, block_q * group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, tile_rows - block_q * group), (0, 0)))
    return q.reshape(num_kv_heads, num_tiles * tile_rows, head_dim)


def from_rows(out: jax.Array, num_tokens: int, num_q_heads: int, block_q: int) -> jax.Array:
    """[Hkv, num_tiles * tile_rows, D] -> [T, Hq, D] (the inverse of ``to_rows``)."""
    num_kv_heads, rows, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    num_tiles = -(-num_tokens // block_q)
    out = out.reshape(num_kv_heads, num_tiles, rows // num_tiles, head_dim)[:, :, : block_q * group]
    out = out.reshape(num_kv_heads, num_tiles, block_q, group, head_dim).transpose(1, 2, 0, 3, 4)
    return out.reshape(num_tiles * block_q, num_q_heads, head_dim)[:num_tokens]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def tile_seq_ranges(
    query_start_loc: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    num_tiles: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array]:
    """Per q tile, the half-open range [lo, hi) of real sequences whose tokens fall in it."""
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * block_q
    bounds = query_start_loc[1:]
    real = jnp.arange(bounds.shape[0], dtype=jnp.int32) < num_seqs[0]
    # Padded sequences get an end of +inf so they never count as "before" a tile.
    ends = jnp.where(real, bounds, jnp.iinfo(jnp.int32).max)
    lo = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(query_start_loc[:-1], starts + block_q, side="left").astype(jnp.int32)
    hi = jnp.minimum(hi, num_seqs[0])
    return lo, jnp.maximum(hi, lo)
