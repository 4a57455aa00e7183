"""Grouped matmul for NVIDIA GPU (Pallas / Mosaic GPU, Hopper sm_90a): the routed experts' product.

``gmm(lhs[M, K], rhs[E, K, N], group_sizes i32[E]) -> [M, N]`` has ``jax.lax.ragged_dot``'s
contract, as ``tpu_gmm.gmm`` does: the rows of ``lhs`` are sorted by group, group ``g`` owns the
``group_sizes[g]`` rows after the groups before it and is multiplied by its ``[K, N]`` matrix;
dropless; rows past ``sum(group_sizes)`` come out zero (``zero_rest=True``) or are left unwritten
(``zero_rest=False``, what ``runtime/moe.grouped_experts`` asks for: it zeroes its sentinel rows).

Why Mosaic GPU and not Pallas' Triton lowering: the project's attention kernels are Mosaic GPU
(``gpu``, ``gpu_decode``), the Triton backend is deprecated upstream, and what this product needs
maps onto Mosaic GPU directly: TMA copies whose source row tile and expert come from scalars read
in the kernel, WGMMA with an f32 accumulator in registers, and TMA stores of a dynamic row range.

One CTA = one warpgroup = one *visit* x one block of ``tn`` output columns. Visits are the (row
tile of ``TM`` = 64 rows, group) pairs in row order, as in ``tpu_gmm``: a tile that straddles two
groups is visited once per group; the grid has ``cdiv(M, TM) + E`` visits (an upper bound) and the
real count, each visit's group and tile and the groups' row offsets come from
``tpu_gmm.group_metadata`` (XLA), read by the kernel as scalars from GMEM; CTAs past the count exit.
A visit streams its row tile [TM, tk] and its expert's [tk, tn] block through a ring of ``stages``
SMEM slots (128-byte swizzle where the tile is 64 bf16 wide; TMA of the next blocks in flight while
WGMMA multiplies this one, ``wgmma_wait(1)`` frees a slot before it is refilled), accumulating in
f32. The epilogue writes the tile's rows of its group only: the f32 accumulator goes to SMEM in the
output dtype and TMA stores the rows [lo, hi) of the tile, as a ladder of at most log2(TM) + 1
stores of 2^i rows (a TMA box has a static size; its start is dynamic), so visits of one tile
write disjoint rows and never race. The rows past the sum are group E: with ``zero_rest`` its
visits multiply nothing and store the zero accumulator; without, it is empty and never visited.
The row tile is fixed at 64 (one WGMMA M): MoE groups are small (Qwen3-30B-A3B, T=512: 32 rows an
expert on average, decode a few), so the expert count - global or a device's slice under expert
parallelism - does not change the tiling here, unlike ``tpu_gmm.tile_sizes``.

``unsupported`` says which operands the kernel takes (bf16/f16, equal dtypes, K and N multiples of
16); ``runtime/moe.gpu_ragged_dot`` sends the rest to ``jax.lax.ragged_dot``. ``interpret=True``
runs the kernel in Pallas' Mosaic GPU interpreter (any host: the tests). Speed: not measured (no
GPU available to the project so far); the compile tier reports its registers and shared memory.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, compat
from pallas_kernels.tpu_gmm import group_metadata

TM = 64  # rows per tile: one warpgroup's WGMMA M
DTYPES = ("bfloat16", "float16")
MAX_STAGES = 4
SMEM_BUDGET = 112 * 1024  # ring + epilogue tile: two CTAs fit an SM's 228 KiB (H100, H200)


class Tiles(NamedTuple):
    tk: int
    tn: int
    stages: int


def _block(d: int, widest: int) -> int | None:
    """The widest of widest, widest/2, ..., 16 elements that divides ``d``."""
    b = widest
    while b >= 16:
        if d % b == 0:
            return b
        b //= 2
    return None


def unsupported(k: int, n: int, lhs_dtype, rhs_dtype) -> str | None:
    """Why the kernel cannot run this product (None: it can)."""
    if jnp.dtype(lhs_dtype) != jnp.dtype(rhs_dtype):
        return f"lhs {jnp.dtype(lhs_dtype)} and rhs {jnp.dtype(rhs_dtype)} differ"
    if jnp.dtype(lhs_dtype).name not in DTYPES:
        return f"{jnp.dtype(lhs_dtype)}: WGMMA operands here are {'/'.join(DTYPES)}"
    if k % 16 or n % 16:
        return f"K {k} and N {n} must be multiples of 16"
    return None


def smem_bytes(t: Tiles, itemsize: int) -> int:
    return (t.stages * (TM * t.tk + t.tk * t.tn) + TM * t.tn) * itemsize


def tile_sizes(k: int, n: int, dtype) -> Tiles:
    """tk: 64 (one 128-byte swizzle row of bf16) or the widest block dividing K; tn: 128 or the
    widest dividing N; stages: as many as the K blocks and the SMEM budget allow."""
    itemsize = jnp.dtype(dtype).itemsize
    tk, tn = _block(k, 128 // itemsize), _block(n, 128)
    if tk is None or tn is None:
        raise ValueError(unsupported(k, n, dtype, dtype) or f"K {k} / N {n}")
    stages = max(1, min(MAX_STAGES, k // tk))
    while stages > 2 and smem_bytes(Tiles(tk, tn, stages), itemsize) > SMEM_BUDGET:
        stages -= 1
    return Tiles(tk, tn, stages)


def _transforms(tk: int, tn: int, dtype):
    """One swizzle for both operands (WGMMA wants them alike): 128 bytes, or tk or tn bytes if fewer."""
    swizzle = min(128, tk * jnp.dtype(dtype).itemsize, tn * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("tiles", "zero_rest", "group_rows", "preferred_element_type",
                                             "interpret"))
def gmm(lhs, rhs, group_sizes, *, tiles: Tiles | None = None, zero_rest: bool = True, group_rows: int | None = None,
        preferred_element_type=None, interpret: bool = False):
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as a Mosaic GPU kernel (module docstring).

    lhs [M, K] rows sorted by group; rhs [E, K, N]; group_sizes i32[E] summing to at most M.
    ``tiles``: (tk, tn, stages), default ``tile_sizes``; ``group_rows`` is accepted for
    ``tpu_gmm.gmm``'s signature and unused (the row tile is always 64). Rows are padded to a whole
    number of tiles when M is not one (a copy)."""
    del group_rows
    m, k = lhs.shape
    e, k2, n = rhs.shape
    if k2 != k or group_sizes.shape != (e,):
        raise ValueError(f"gmm: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} do not match")
    reason = unsupported(k, n, lhs.dtype, rhs.dtype)
    if reason:
        raise ValueError(f"gmm (Mosaic GPU): {reason}")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    tk, tn, stages = tiles or tile_sizes(k, n, lhs.dtype)
    if k % tk or n % tn:
        raise ValueError(f"gmm: tk {tk} must divide K {k} and tn {tn} N {n}")
    mp = common.round_up(m, TM)
    x = lhs if mp == m else jnp.pad(lhs, ((0, mp - m), (0, 0)))
    md = group_metadata(group_sizes, mp if zero_rest else m, TM, zero_rest)
    visits = md.group_ids.shape[0]
    tiles_k = k // tk
    stages = min(stages, tiles_k)
    if stages < 2 and tiles_k > 1:  # one slot cannot be refilled while it is read
        raise ValueError(f"gmm: {tiles_k} K blocks need 2 stages at least")
    dtype = lhs.dtype

    def body(offsets_g, gids_g, tids_g, nv_g, lhs_g, rhs_g, out_g, scoped):
        lhs_smem, rhs_smem, out_smem, bars = scoped
        v = lax.axis_index("visit")
        nb = lax.axis_index("n")

        @pl.when(v < nv_g[0])
        def _visit():
            g = gids_g[v]
            row0 = tids_g[v] * TM
            lo = jnp.maximum(offsets_g[g], row0) - row0  # the tile's rows of group g: [lo, hi)
            hi = jnp.minimum(offsets_g[g + 1], row0 + TM) - row0
            expert = jnp.minimum(g, e - 1)
            n_k = jnp.where(g < e, tiles_k, 0)  # group e (rows past the sum): nothing to multiply
            cols = pl.ds(nb * tn, tn)

            def fetch(kb, slot):
                plgpu.copy_gmem_to_smem(lhs_g.at[pl.ds(row0, TM), pl.ds(kb * tk, tk)], lhs_smem.at[slot],
                                        bars.at[slot])
                plgpu.copy_gmem_to_smem(rhs_g.at[expert, pl.ds(kb * tk, tk), cols], rhs_smem.at[slot],
                                        bars.at[slot])

            def accumulate(acc_ref):
                for i in range(stages):
                    @pl.when(i < n_k)
                    def _(i=i):
                        fetch(i, i)

                def step(kb, carry):
                    slot = lax.rem(kb, jnp.int32(stages))
                    plgpu.barrier_wait(bars.at[slot])
                    plgpu.wgmma(acc_ref, lhs_smem.at[slot], rhs_smem.at[slot])
                    plgpu.wgmma_wait(1)  # step kb-1's product is done: its slot takes block kb-1+stages
                    ahead = kb - 1 + stages

                    @pl.when((kb > 0) & (ahead < n_k))
                    def _():
                        fetch(ahead, lax.rem(ahead, jnp.int32(stages)))

                    return carry

                lax.fori_loop(0, n_k, step, jnp.int32(0))
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((TM, tn), jnp.float32))
            out_smem[...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            # rows [lo, hi) as TMA stores of 2^i rows (static boxes, dynamic starts), largest first
            start, size, rows = lo, hi - lo, TM
            while rows >= 1:
                @pl.when((size & rows) != 0)
                def _(start=start, rows=rows):
                    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(start, rows)], out_g.at[pl.ds(row0 + start, rows), cols])

                start = start + (size & rows)
                rows //= 2
            plgpu.wait_smem_to_gmem(0)

    scratch = (
        plgpu.SMEM((stages, TM, tk), dtype, transforms=_transforms(tk, tn, dtype)),
        plgpu.SMEM((stages, tk, tn), dtype, transforms=_transforms(tk, tn, dtype)),
        plgpu.SMEM((TM, tn), out_dtype),  # untiled: the epilogue slices it at any row
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    )

    def gmm_gpu(*refs):  # named: the kernel's name in ptxas' report and profiles
        return pl.run_scoped(lambda *s: body(*refs, s), *scratch)

    kernel = plgpu.kernel(
        gmm_gpu,
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(n // tn, visits),
        grid_names=("n", "visit"),
        compiler_params=compat.gpu_compiler_params(),
        interpret=compat.gpu_interpret_params() if interpret else None,
    )
    out = kernel(*md, x, rhs)
    return out if mp == m else out[:m]
