"""Launch planning of the Mosaic TPU attention kernel (``tpu``): block sizes per step kind, the
VMEM and SMEM each call needs (its ``vmem_limit_bytes`` comes from ``vmem_estimate`` through
``tpu_budget``), and how many sequences' block tables one call holds in SMEM. Shapes only.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common, tpu_budget
from pallas_kernels.tpu_layout import LANES

TABLE_SMEM_BYTES = tpu_budget.TABLE_SMEM_BYTES
CHUNK_VMEM_BYTES = 4 << 20  # both slots of the K/V chunk buffer


def block_sizes(decode_only: bool, group: int, block_size: int, *, num_kv_heads: int = 8,
                head_dim: int = 128, itemsize: int = 2) -> dict[str, int]:
    """The one table of TPU block sizes, by step kind (a static property of the bucket).

    Decode: one token (one sequence) per program, so each sequence's pages stream once with only
    its own G rows on the MXU, 256-token chunks. Prefill/mixed: about 128 q rows per tile
    (MXU-shaped), 128-token chunks. Chunks shrink so both K/V slots fit ``CHUNK_VMEM_BYTES``.
    """
    tokens = 256 if decode_only else 128
    page_bytes = 2 * num_kv_heads * block_size * common.round_up(head_dim, LANES) * itemsize
    ppc = max(1, min(tokens // block_size, CHUNK_VMEM_BYTES // (2 * page_bytes)))
    return {"block_q": 1 if decode_only else max(1, 128 // group), "pages_per_chunk": ppc}


def vmem_estimate(*, num_kv_heads: int, rows: int, head_dim: int, q_dtype, kv_dtype, block_size: int,
                  pages_per_chunk: int, quantized: bool = False, sinks: bool = False) -> int:
    """VMEM bytes of one attention call: the double-buffered q and output blocks, both K/V chunk
    slots, m/l (one lane used, 128 allocated) and acc, the scales' chunk slots, and the [rows,
    chunk] f32 scores and probabilities that Mosaic keeps in VMEM for each head of the unrolled
    head loop (its stack grows with the heads: with one head's tiles budgeted, 32 KV heads at d64
    needed 22.3 MiB on v6e against an estimate of 14.2 MiB)."""
    dp, chunk = common.round_up(head_dim, LANES), pages_per_chunk * block_size
    q_item, kv_item = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    total = 4 * tpu_budget.vmem_tile_bytes((num_kv_heads, rows, dp), q_item)  # q, o: 2 buffers each
    total += tpu_budget.vmem_tile_bytes((2, 2 * num_kv_heads, chunk, dp), kv_item)
    total += 2 * tpu_budget.vmem_tile_bytes((num_kv_heads, rows, 1), 4)
    total += tpu_budget.vmem_tile_bytes((num_kv_heads, rows, dp), 4)
    if quantized:
        total += tpu_budget.vmem_tile_bytes((2, pages_per_chunk, 2 * num_kv_heads, block_size), 4)
    if sinks:  # the rows' sink logits [Hkv, rows, 1], double-buffered like any input block
        total += 2 * tpu_budget.vmem_tile_bytes((num_kv_heads, rows, 1), 4)
    return total + 3 * num_kv_heads * tpu_budget.vmem_tile_bytes((rows, chunk), 4)


def smem_estimate(*, num_seqs: int, max_blocks: int, num_tiles: int,
                  table_smem_bytes: int = TABLE_SMEM_BYTES) -> int:
    """SMEM bytes of one attention call: lengths, query starts, the call's table rows (at most
    ``table_smem_bytes``, ``table_rows``), the tile ranges and the pipeline state."""
    rows = table_rows(num_seqs, max_blocks, table_smem_bytes)
    words = (num_seqs, num_seqs + 1, rows * max_blocks, num_tiles, num_tiles, 2)
    return sum(tpu_budget.smem_array_bytes(w) for w in words)


def table_rows(num_seqs: int, max_blocks: int, table_smem_bytes: int = TABLE_SMEM_BYTES) -> int:
    """Sequences whose block tables one call prefetches into SMEM: all of them when they fit
    ``table_smem_bytes``, else as many as fit (a longer ``max_model_len`` splits the batch's
    sequences over several calls); an error when not even one sequence's row fits."""
    per_seq = tpu_budget.smem_array_bytes(max_blocks)
    if per_seq > table_smem_bytes:
        raise ValueError(f"one sequence's block table ({max_blocks} blocks, {per_seq} B) exceeds the "
                         f"{table_smem_bytes} B of SMEM for tables: use a larger block size or a "
                         "shorter max_model_len")
    if tpu_budget.smem_array_bytes(num_seqs * max_blocks) <= table_smem_bytes:
        return num_seqs
    return max(1, table_smem_bytes // per_seq)
