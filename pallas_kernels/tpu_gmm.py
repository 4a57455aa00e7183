"""Grouped matmul for TPU (Pallas / Mosaic TPU), megablox class: the routed experts' product.

``gmm(lhs[M, K], rhs[E, K, N], group_sizes i32[E]) -> [M, N]`` has ``jax.lax.ragged_dot``'s
contract: the rows of ``lhs`` are sorted by group, group ``g`` owns the ``group_sizes[g]`` rows
after the groups before it, and each row is multiplied by its group's ``[K, N]`` matrix. Dropless:
every row of every group is computed, and nothing is computed for an empty group. Rows past
``sum(group_sizes)`` come out zero (``zero_rest=True``, ragged_dot's result) or are left unwritten
(``zero_rest=False``: the caller ignores them, as ``runtime/moe.grouped_experts`` does with the
rows of its sentinel group, so no grid step ever touches them).

Tiling: rows in tiles of ``tm`` (a multiple of the dtype's sublane packing: 8 rows of f32, 16 of
bf16), the contraction in ``tk`` and the output columns in ``tn`` (multiples of the 128 lanes, or
the whole dimension), chosen by ``tile_sizes`` from the shapes and a VMEM budget. The grid is
``(N / tn, visits, K / tk)``: the middle axis walks the *visits*, the (row tile, group) pairs in
row order, so a tile that straddles two groups is visited once per group. Its static length is
``cdiv(M, tm) + E``, an upper bound on the visits (each group boundary inside a tile adds one);
the real count, each visit's group and row tile, and the groups' row offsets are computed in XLA
(``group_metadata``) and scalar-prefetched into SMEM, where the BlockSpec index maps read them:
a visit fetches its row tile of ``lhs`` and its group's ``[tk, tn]`` block of ``rhs``, and Pallas
skips the copy when the block index repeats (consecutive visits of one group keep its weights;
the steps past the real count repeat the last visit's blocks and do nothing). The product
accumulates in an f32 VMEM scratch over the K steps; on the last one the visit's rows - a mask of
the group's row range over the tile - are written into the output tile, which stays in VMEM
across the consecutive visits of its row tile, so the tile's other groups fill the other rows.
The rows past the sum form one more group (index E) whose visits write zeros and multiply nothing.
``vmem_limit_bytes`` is set from the blocks' estimate (``pallas_kernels.tpu_budget``).

``interpret=True`` runs the kernel in Pallas' TPU interpreter (any host: the tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, tpu_budget

LANES = 128
MAX_TM = 256  # rows per tile: the v6e MXU's width (two passes of v5e's 128)
BLOCK_VMEM_BYTES = 16 * tpu_budget.MiB  # what the double-buffered blocks and the scratch may take


class Tiles(NamedTuple):
    tm: int
    tk: int
    tn: int


def sublanes(dtype) -> int:
    """Rows per (sublane, 128-lane) tile of ``dtype``: 8 of 32-bit, 16 of 16-bit, 32 of 8-bit."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def vmem_estimate(t: Tiles, lhs_dtype, rhs_dtype, out_dtype) -> int:
    """Bytes of VMEM: two buffers each of the lhs, rhs and output blocks, and the f32 accumulator."""
    b = tpu_budget.vmem_tile_bytes
    blocks = (b((t.tm, t.tk), jnp.dtype(lhs_dtype).itemsize) + b((t.tk, t.tn), jnp.dtype(rhs_dtype).itemsize)
              + b((t.tm, t.tn), jnp.dtype(out_dtype).itemsize))
    return 2 * blocks + b((t.tm, t.tn), 4)


def _halve(d: int) -> int | None:
    """The next smaller block of a lane-tiled dimension ``d``: half, if still whole 128-lane tiles."""
    return d // 2 if d % (2 * LANES) == 0 else None


def tile_sizes(m: int, k: int, n: int, num_groups: int, lhs_dtype, rhs_dtype=None,
               budget: int = BLOCK_VMEM_BYTES, group_rows: int | None = None) -> Tiles:
    """Block sizes for an [m, k] x [num_groups, k, n] grouped product.

    ``tm``: about the mean group size (``group_rows``, default rows / groups), rounded up to the
    sublane packing, at most ``MAX_TM``: a tile straddling g groups is multiplied g times, so small
    groups (decode: a few rows per expert) want small tiles. ``tk`` and ``tn`` start whole (each expert's weights read
    once per visit; a dimension that is not whole 128-lane tiles stays whole) and the larger is
    halved while the blocks exceed ``budget``."""
    rhs_dtype = rhs_dtype or lhs_dtype
    pack = max(sublanes(lhs_dtype), sublanes(rhs_dtype))
    mean = group_rows or -(-m // max(num_groups, 1))
    tm = min(MAX_TM, tpu_budget.round_up(max(mean, 1), pack))
    tk, tn = k, n
    while vmem_estimate(Tiles(tm, tk, tn), lhs_dtype, rhs_dtype, lhs_dtype) > budget:
        options = [(d, which) for d, which in ((tk, "k"), (tn, "n")) if _halve(d)]
        if not options:
            break
        if max(options)[1] == "k":
            tk = _halve(tk)
        else:
            tn = _halve(tn)
    return Tiles(tm, tk, tn)


class GroupMetadata(NamedTuple):
    """What the kernel prefetches into SMEM (all i32): ``offsets[E + 2]`` each group's first row
    (group E: the rows past the sum) and the end; ``group_ids[V]`` / ``tile_ids[V]`` each visit's
    group and row tile (past the real count: the last real visit again); ``num_visits[1]``."""

    offsets: jax.Array
    group_ids: jax.Array
    tile_ids: jax.Array
    num_visits: jax.Array


def group_metadata(group_sizes, m: int, tm: int, zero_rest: bool) -> GroupMetadata:
    """The visits (row tile, group) in row order, for ``cdiv(m, tm) + E`` grid steps."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    rest = m - jnp.sum(sizes) if zero_rest else jnp.int32(0)
    sizes = jnp.concatenate([sizes, jnp.reshape(rest, (1,)).astype(jnp.int32)])  # group e: the rows past the sum
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = starts // tm
    tiles = jnp.where(sizes > 0, (ends - 1) // tm - first_tile + 1, 0)  # row tiles each group touches
    visit_end = jnp.cumsum(tiles)
    num_visits = visit_end[-1]
    v = jnp.minimum(jnp.arange(-(-m // tm) + e, dtype=jnp.int32), jnp.maximum(num_visits - 1, 0))
    g = jnp.minimum(jnp.searchsorted(visit_end, v, side="right"), e).astype(jnp.int32)
    tile = first_tile[g] + v - (visit_end[g] - tiles[g])
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]).astype(jnp.int32)
    return GroupMetadata(offsets, g, tile.astype(jnp.int32), jnp.reshape(num_visits, (1,)).astype(jnp.int32))


def _kernel(offsets_ref, gid_ref, tid_ref, nv_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
            num_groups: int, tiles_k: int):
    """One (column block, visit, K block) step: accumulate this visit's product; on the last K
    block write the visit's rows of the output tile (group ``num_groups`` writes zeros)."""
    v, kb = pl.program_id(1), pl.program_id(2)
    g = gid_ref[v]

    @pl.when(v < nv_ref[0])
    def _visit():
        @pl.when(kb == 0)
        def _init():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(g < num_groups)
        def _multiply():
            rhs = rhs_ref[...]
            lhs = lhs_ref[...]
            if lhs.dtype != rhs.dtype:
                rhs = rhs.astype(lhs.dtype)
            acc_ref[...] += jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)

        @pl.when(kb == tiles_k - 1)
        def _store():
            tm, tn = out_ref.shape
            rows = tid_ref[v] * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            mine = (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])
            out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("tiles", "zero_rest", "group_rows", "preferred_element_type",
                                             "interpret"))
def gmm(lhs, rhs, group_sizes, *, tiles: Tiles | None = None, zero_rest: bool = True, group_rows: int | None = None,
        preferred_element_type=None, interpret: bool = False):
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as a Pallas TPU kernel (module docstring).

    lhs [M, K] rows sorted by group; rhs [E, K, N]; group_sizes i32[E] summing to at most M.
    ``tiles``: (tm, tk, tn), default ``tile_sizes`` (``group_rows``: the rows a group is expected
    to hold, when most of the M rows are in no group); tk must divide K and tn N (else they are
    the whole dimension). Rows are padded to a whole number of tiles when M is not one (a copy)."""
    m, k = lhs.shape
    e, k2, n = rhs.shape
    if k2 != k or group_sizes.shape != (e,):
        raise ValueError(f"gmm: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} do not match")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    t = tiles or tile_sizes(m, k, n, e, lhs.dtype, rhs.dtype, group_rows=group_rows)
    tm = t.tm
    tk = t.tk if k % t.tk == 0 else k
    tn = t.tn if n % t.tn == 0 else n
    mp = tpu_budget.round_up(m, tm)
    x = lhs if mp == m else jnp.pad(lhs, ((0, mp - m), (0, 0)))
    md = group_metadata(group_sizes, mp if zero_rest else m, tm, zero_rest)
    tiles_k = k // tk
    visits = md.group_ids.shape[0]

    def lhs_map(nb, v, kb, offsets, gids, tids, nv):
        return tids[v], kb

    def rhs_map(nb, v, kb, offsets, gids, tids, nv):
        return jnp.minimum(gids[v], e - 1), kb, nb

    def out_map(nb, v, kb, offsets, gids, tids, nv):
        return tids[v], nb

    estimate = vmem_estimate(Tiles(tm, tk, tn), lhs.dtype, rhs.dtype, out_dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, num_groups=e, tiles_k=tiles_k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(n // tn, visits, tiles_k),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((None, tk, tn), rhs_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        # visits of one row tile must run in order (they share its output block); column blocks
        # are independent (split over a megacore's two TensorCores)
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=tpu_budget.vmem_limit(estimate)),
        interpret=compat.tpu_interpret_params() if interpret else False,
        name="gmm_tpu",
    )(*md, x, rhs)
    return out if mp == m else out[:m]
