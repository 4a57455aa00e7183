"""Attention backends: write new K/V into the paged cache, then ragged paged attention.

A *kernel* has the signature of `pallas_kernels.reference.ragged_paged_attention`: q[T, Hq, D]
against one layer's pages [num_blocks, block_size, Hkv, D], with a ragged batch described by
seq_lens / query_start_loc / block_tables / num_seqs. A *backend* (what the model calls, see
`layer_attention`) pairs a kernel with a KV write. The backend (backend.py) picks one by name once
(`--attention-backend`): `pallas` is the kernel path on TPU/GPU, `cpu` a native kernel and write
for XLA:CPU (cpu_kernels.py, the `cpu-tiled` KV layout), `xla` the portable fallback.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.runtime.rope_fusion import Rope

# The XLA KV write is one scatter (in place: the pages are donated); the tpu-fused layout has its
# own Pallas write kernel (pallas_kernels.write_kv).
from pallas_kernels.kv_quant import gather
from pallas_kernels.reference import token_layout, write_kv  # noqa: F401  (re-exported)


class AttentionMetadata(NamedTuple):
    """Per-step batch layout, shared by all layers (a pytree of device arrays)."""

    slot_mapping: jax.Array  # i32[T] flat KV slot each new token writes (padding -> null block 0)
    seq_lens: jax.Array  # i32[S] context length incl. this step's tokens (0 for padding seqs)
    query_start_loc: jax.Array  # i32[S+1] cumulative new-token counts
    block_tables: jax.Array  # i32[S, C]: C block columns (the step's context bucket, or max_blocks)
    num_seqs: jax.Array  # i32[1]


def pages_at(pages, blk):
    """The pages of block ids ``blk`` (any shape) as [*blk.shape, block_size, Hkv, D] float32
    (dequantized for int8/fp8 pages): the one place this path reads the cache."""
    return gather(pages, blk)


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
    sinks=None,  # f32[Hq] or None: per-head logits in the softmax denominator (gpt-oss)
    decode_rows: int = 16,
    decode_blocks_per_chunk: int = 8,
    prefill_rows: int = 128,
    blocks_per_chunk: int = 8,
    static_bounds: bool = True,
):
    """Ragged paged attention in plain XLA: flash-style loops whose trip counts are static.

    Every loop bound comes from the shapes (T, S, and the table's width: the step's context bucket
    C, `BucketKey.c`, so a step of short contexts is not scanned to max_model_len), never from the
    batch's values, so XLA sees fixed-count loops (no data-dependent ``while``, which on GPU costs a
    device->host sync per iteration); masking makes the extra iterations no-ops. ``static_bounds=False``
    (XLA:CPU, where a while loop is cheap and reading the whole block table is not) stops each
    loop at the batch's own extent instead; the loops are the same. Two parts:

    - decode: rows [0, min(S, T)) that are one-token sequences (the batch builder puts decode
      rows first), a block of ``decode_rows`` at a time, each row gathering its own pages over
      the whole block table;
    - prefill: every other real row, in tiles of ``prefill_rows``. The (tile, sequence) pairs
      with rows in common are at most num_tiles + P - 1, P the most sequences that can have
      prefill rows (S, or T // 2 when T <= S); each pair reads its sequence's pages
      once, chunk by chunk, against all of the tile's rows with one matmul.
    """
    t, hq, d = q.shape
    nb, bs, hkv, _ = k_pages.shape
    g = hq // hkv
    s_max, max_blocks = block_tables.shape
    chunk = blocks_per_chunk * bs
    dchunk, dbpc = decode_blocks_per_chunk * bs, decode_blocks_per_chunk
    nd = min(s_max, t)  # rows that may be decode rows of the decode part
    rd, rp = min(decode_rows, nd), min(prefill_rows, t)
    num_dblocks, num_tiles = -(-nd // rd), -(-t // rp)
    # Sequences with prefill rows: >= 2 rows each when every row is a decode candidate (T <= S).
    max_prefill_seqs = t // 2 if t <= s_max else s_max
    num_pairs = num_tiles + max_prefill_seqs - 1 if max_prefill_seqs else 0
    num_dchunks, num_chunks = -(-max_blocks // dbpc), -(-max_blocks // blocks_per_chunk)

    seq, pos, valid = token_layout(seq_lens, query_start_loc, num_seqs, t)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    rows = jnp.arange(t, dtype=jnp.int32)
    in_decode = valid & (q_len == 1) & (rows < nd)
    in_prefill = valid & ~in_decode
    tables = jnp.pad(block_tables, ((0, 0), (0, (-max_blocks) % math.lcm(blocks_per_chunk, dbpc))))
    qf = q.reshape(t, hkv, g, d).astype(jnp.float32) * sm_scale
    pad = num_tiles * rp - t
    padded = lambda x, v=0: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=v)  # noqa: E731
    seq_p, pos_p, pre_p, qf_p = padded(seq), padded(pos, -1), padded(in_prefill, False), padded(qf)

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

    def bound(static: int, extent):
        """A loop's trip count: the shapes' ``static`` one, or the data's ``extent`` (<= it)."""
        return static if static_bounds else jnp.minimum(extent, static)

    # Decode part: per-row page gather; rows that are not decode rows see nothing.
    dq = jnp.pad(qf[:nd], ((0, num_dblocks * rd - nd), (0, 0), (0, 0), (0, 0)))
    dseq = jnp.pad(seq[:nd], (0, num_dblocks * rd - nd))
    dpos = jnp.pad(jnp.where(in_decode, pos, -1)[:nd], (0, num_dblocks * rd - nd), constant_values=-1)

    def decode_block(i, out):
        start = i * rd
        rseq = jax.lax.dynamic_slice_in_dim(dseq, start, rd)
        rpos = jax.lax.dynamic_slice_in_dim(dpos, start, rd)
        rq = jax.lax.dynamic_slice_in_dim(dq, start, rd)
        rtab = tables[rseq]

        def kv_chunk(c, inner):
            blk = jax.lax.dynamic_slice_in_dim(rtab, c * dbpc, dbpc, axis=1)
            kv_pos = c * dchunk + jnp.arange(dchunk, dtype=jnp.int32)
            ok = visible(kv_pos, rpos)
            k = pages_at(k_pages, blk).reshape(rd, dchunk, hkv, d)
            v = jnp.where(ok[:, :, None, None], pages_at(v_pages, blk).reshape(rd, dchunk, hkv, d), 0.0)
            return online(inner, jnp.einsum("rkgd,rckd->rkgc", rq, k), v, ok[:, None, None, :], "rkgc,rckd->rkgd")

        state = jax.lax.fori_loop(0, bound(num_dchunks, (jnp.max(rpos) + dchunk) // dchunk), kv_chunk, empty(rd))
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, x, start, 0) for o, x in zip(out, state))

    decode_extent = (jnp.max(jnp.where(in_decode[:nd], rows[:nd], -1)) + rd) // rd
    m_d, l_d, acc_d = jax.lax.fori_loop(0, bound(num_dblocks, decode_extent), decode_block,
                                        empty(num_dblocks * rd))

    # Prefill part: the (tile, sequence) pairs, in order; pair p belongs to tile pair_tile[p].
    tile_rows = seq_p.reshape(num_tiles, rp)
    tile_pre = pre_p.reshape(num_tiles, rp)
    s_first = jnp.min(jnp.where(tile_pre, tile_rows, s_max), axis=1)
    s_last = jnp.max(jnp.where(tile_pre, tile_rows, -1), axis=1)
    count = jnp.maximum(s_last - s_first + 1, 0)
    ends = jnp.cumsum(count)
    pair = jnp.arange(num_pairs, dtype=jnp.int32)
    pair_tile = jnp.minimum(jnp.searchsorted(ends, pair, side="right"), num_tiles - 1).astype(jnp.int32)
    pair_seq = s_first[pair_tile] + pair - (ends[pair_tile] - count[pair_tile])
    pair_real = pair < ends[-1]

    def prefill_pair(p, out):
        start = pair_tile[p] * rp
        sid = jnp.where(pair_real[p], jnp.clip(pair_seq[p], 0, s_max - 1), 0)
        rseq = jax.lax.dynamic_slice_in_dim(seq_p, start, rp)
        rpos = jax.lax.dynamic_slice_in_dim(pos_p, start, rp)
        mine = jax.lax.dynamic_slice_in_dim(pre_p, start, rp) & (rseq == sid) & pair_real[p]
        rq = jax.lax.dynamic_slice_in_dim(qf_p, start, rp)
        top = jnp.max(jnp.where(mine, rpos, -1))

        def kv_chunk(c, inner):
            blk = jax.lax.dynamic_slice_in_dim(tables[sid], c * blocks_per_chunk, blocks_per_chunk)
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            ok = visible(kv_pos, rpos) & mine[:, None]
            k = pages_at(k_pages, blk).reshape(chunk, hkv, d)
            v = jnp.where((kv_pos <= top)[:, None, None], pages_at(v_pages, blk).reshape(chunk, hkv, d), 0.0)
            return online(inner, jnp.einsum("rkgd,ckd->rkgc", rq, k), v, ok[:, None, None, :], "rkgc,ckd->rkgd")

        state = tuple(jax.lax.dynamic_slice_in_dim(o, start, rp) for o in out)
        state = jax.lax.fori_loop(0, bound(num_chunks, (top + chunk) // chunk), kv_chunk, state)
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, x, start, 0) for o, x in zip(out, state))

    state = empty(num_tiles * rp)
    if num_pairs:
        m_p, l_p, acc_p = jax.lax.fori_loop(0, bound(num_pairs, ends[-1]), prefill_pair, state)
    else:
        m_p, l_p, acc_p = state
    pad_d = ((0, t - nd), (0, 0), (0, 0))
    dec = in_decode[:, None, None]
    l_all = jnp.where(dec, jnp.pad(l_d[:nd], pad_d), l_p[:t])
    acc_all = jnp.where(dec[..., None], jnp.pad(acc_d[:nd], pad_d + ((0, 0),)), acc_p[:t])
    if sinks is not None:  # the sink's exp(logit - running max) joins the denominator
        m_all = jnp.where(dec, jnp.pad(m_d[:nd], pad_d, constant_values=-jnp.inf), m_p[:t])
        m_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
        l_all = l_all + jnp.exp(sinks.astype(jnp.float32).reshape(hkv, g)[None] - m_safe)
    out = acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


KernelFn = Callable[..., jax.Array]
# (q, k_new, v_new, k_pages, v_pages, md, *, sm_scale, sliding_window) -> (out, k_pages, v_pages)
AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
BACKENDS = ("xla", "pallas", "cpu")
log = logging.getLogger(__name__)


def get_backend(name: str, platform: str | None = None, decode_only: bool = False, isa: int = 0) -> KernelFn:
    """The attention kernel of a backend; ``platform`` (gpu/tpu) names the Pallas kernel's target
    when it is not this host's (`jaxserve lower` exports for it). ``decode_only``: a step of one
    decode token per sequence, token t of sequence t (pallas: the split-KV kernel on GPU, the
    decode block sizes on TPU; the other backends serve every step alike). ``isa``: the native CPU
    kernel's instructions (cpu_kernels.attention_isa)."""
    if name == "xla":  # static loop bounds except on XLA:CPU (see xla_ragged_paged_attention)
        on_cpu = (platform or jax.default_backend()) == "cpu"
        return functools.partial(xla_ragged_paged_attention, static_bounds=not on_cpu)
    if name == "pallas":
        import pallas_kernels

        kernel = {"gpu": "gpu", "tpu": "tpu"}.get(platform, "auto")
        # No Pallas lowering for CPU: run the kernel in interpret mode there (tests, numerics).
        interpret = kernel == "auto" and jax.default_backend() == "cpu"
        return pallas_kernels.for_step(decode_only=decode_only, backend=kernel, interpret=interpret)
    if name == "cpu":
        from jaxserve.runtime import cpu_kernels

        return functools.partial(cpu_kernels.cpu_ragged_paged_attention, isa=isa)
    raise ValueError(f"Unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}.")


def layer_attention(name: str, platform: str | None = None, decode_only: bool = False,
                    kv_layout: str = "paged", isa: int = 0) -> AttentionFn:
    """What one model layer calls: write this step's K/V into its pages, then attend over them.
    With the ``tpu-fused`` layout ``k_pages`` is the layer's one array and ``v_pages`` None; the
    Pallas write kernel fills it. ``rope`` (runtime/rope_fusion.py): q and k come unrotated, and
    the native CPU calls rotate them as they read them; the other backends apply it first."""
    kernel = get_backend(name, platform, decode_only, isa)
    write = write_kv
    if name == "cpu":
        from jaxserve.runtime.cpu_kernels import cpu_write_kv as write
    if kv_layout == "tpu-fused":
        import pallas_kernels

        interpret = platform != "tpu" and jax.default_backend() == "cpu"
        write = functools.partial(pallas_kernels.write_kv, backend="tpu", interpret=interpret)

    fused_rope = name == "cpu"  # its KV write and kernel rotate k and q as they read them

    def attend(q, k, v, k_pages, v_pages, md: AttentionMetadata, rope: Rope | None = None, **kw):
        if rope is not None and not fused_rope:
            q, k, rope = rope(q), rope(k), None
        rot = {} if rope is None else {"rope": rope}
        k_pages, v_pages = write(k_pages, v_pages, k, v, md.slot_mapping, **rot)
        out = kernel(q, k_pages, v_pages, md.seq_lens, md.query_start_loc, md.block_tables, md.num_seqs, **kw, **rot)
        return out, k_pages, v_pages

    return attend
