"""KV-cache write for TPU (Pallas / Mosaic TPU): this step's new K/V rows into their page slots.

``write_kv_fused`` (the engine's path, the ``tpu-fused`` layout of ``pallas_kernels.tpu``): a token
row is one sublane row of each (block_size, Dp) tile, and a DMA can only address whole tiles
(Mosaic rejects the sub-tile slice), so the kernel works by whole pages: a page is read into VMEM
once, every consecutive new token of it selected into its row, and written back when the next
token goes to another page. Grid steps of ``tokens_per_step`` tokens run in order and the held
page carries over (a prefill fills a page over several steps with one read and one write).

``write_kv_tpu`` (separate [nb, bs, Hkv, D] K and V pages, the generic API): grid
``(cdiv(T, tokens_per_step),)``, ``slot_mapping`` scalar-prefetched into SMEM, and one async DMA
per (K|V, token) of its [Hkv, D] rows (whole tiles there), all started, then all waited.

The pages never leave HBM (``memory_space=pl.ANY``) and are aliased input -> output, so the update
is in place when the caller donates the pages. Rows past ``T`` in the last (partial) step are
skipped. Padding tokens all point into the null block 0; their rows may land anywhere in it (same
contract as ``reference.write_kv``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, tpu_budget
from pallas_kernels.kv_quant import QuantPages, quantize


def _kernel(
    # scalar prefetch (SMEM)
    slots_ref,  # i32[T]
    # inputs
    k_pages_in,  # [num_blocks, block_size, Hkv, D] (HBM, aliased to k_pages_out)
    v_pages_in,  # [num_blocks, block_size, Hkv, D] (HBM, aliased to v_pages_out)
    k_ref,  # [tokens_per_step, Hkv, D] (VMEM block)
    v_ref,  # [tokens_per_step, Hkv, D] (VMEM block)
    # outputs
    k_pages_out,  # [num_blocks, block_size, Hkv, D] (HBM)
    v_pages_out,  # [num_blocks, block_size, Hkv, D] (HBM)
    # scratch
    sems,  # DMA[2, tokens_per_step]  (k/v, row)
    *,
    tokens_per_step: int,
    block_size: int,
    num_tokens: int,
):
    del k_pages_in, v_pages_in  # same buffers as the outputs
    step = pl.program_id(0)
    copies = []
    for j in range(tokens_per_step):
        t = step * tokens_per_step + j
        valid = t < num_tokens
        # Clamp so the SMEM read stays in bounds for the skipped rows of the last step.
        slot = slots_ref[jnp.minimum(t, num_tokens - 1)]
        block = lax.div(slot, block_size)
        offset = lax.rem(slot, block_size)
        for kv, (src, dst) in enumerate(((k_ref, k_pages_out), (v_ref, v_pages_out))):
            copies.append(
                (valid, pltpu.make_async_copy(src.at[j], dst.at[block, offset], sems.at[kv, j]))
            )
    for valid, cp in copies:
        pl.when(valid)(cp.start)
    for valid, cp in copies:
        pl.when(valid)(cp.wait)


def write_kv_tpu(
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]; slot = block_id * block_size + offset
    *,
    tokens_per_step: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    _, block_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = k.shape[0]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {k.shape} / v {v.shape} do not match pages {k_pages.shape}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} != ({num_tokens},)")
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    if num_tokens == 0:
        return k_pages, v_pages

    kernel = functools.partial(
        _kernel, tokens_per_step=tokens_per_step, block_size=block_size, num_tokens=num_tokens
    )
    row_spec = pl.BlockSpec((tokens_per_step, num_kv_heads, head_dim), lambda i, *_: (i, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(pl.cdiv(num_tokens, tokens_per_step),),
        in_specs=[any_spec, any_spec, row_spec, row_spec],
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.SemaphoreType.DMA((2, tokens_per_step))],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        # Operand indices count the scalar-prefetch operand: 0 slots, 1 k_pages, 2 v_pages.
        input_output_aliases={1: 0, 2: 1},
        compiler_params=compat.tpu_compiler_params(
            # Steps write disjoint real slots (only padding rows share block 0).
            dimension_semantics=("parallel",),
        ),
        interpret=compat.tpu_interpret_params() if interpret else False,
        name="write_kv_tpu",
    )(
        slot_mapping.astype(jnp.int32),
        k_pages,
        v_pages,
        k.astype(k_pages.dtype),
        v.astype(v_pages.dtype),
    )


def _fused_kernel(slots_ref, kv_in, new_ref, kv_out, page, sems, current, *, tokens_per_step: int,
                  block_size: int, num_tokens: int):
    """Each new token's [2 * Hkv, 1, Dp] rows into row ``offset`` of its page, by whole pages: a
    token row is a sub-tile slice of the (block_size, Dp) tiles, which a DMA cannot address, so the
    page is read into VMEM once, every consecutive token of it selected in, and written back when
    the next token goes elsewhere (or at the end). Steps run in order; ``current`` (SMEM) is the
    page held in VMEM across them, -1 for none."""
    del kv_in  # same buffer as kv_out
    step = pl.program_id(0)

    def copy(src, dst, sem):
        cp = pltpu.make_async_copy(src, dst, sems.at[sem])
        cp.start()
        cp.wait()

    @pl.when(step == 0)
    def _():
        current[0] = -1

    rows = lax.broadcasted_iota(jnp.int32, page.shape, 1)
    for j in range(tokens_per_step):
        t = step * tokens_per_step + j
        slot = slots_ref[jnp.minimum(t, num_tokens - 1)]
        block = lax.div(slot, block_size)
        offset = lax.rem(slot, block_size)

        @pl.when((t < num_tokens) & (block != current[0]))
        def _():
            @pl.when(current[0] >= 0)
            def _():
                copy(page, kv_out.at[current[0]], 1)

            copy(kv_out.at[block], page, 0)
            current[0] = block

        @pl.when(t < num_tokens)
        def _():
            page[...] = jnp.where(rows == offset, jnp.broadcast_to(new_ref[j], page.shape), page[...])

    @pl.when((step == pl.num_programs(0) - 1) & (current[0] >= 0))
    def _():
        copy(page, kv_out.at[current[0]], 1)


def fused_vmem_estimate(num_kv_heads: int, head_dim: int, block_size: int, dtype,
                        tokens_per_step: int = 8) -> int:
    """VMEM bytes of the fused write: the double-buffered new rows ([tokens, 2 * Hkv, 1, Dp], a
    sublane tile per row), the page held across steps and two page-sized select temporaries."""
    dp, item = tpu_budget.round_up(head_dim, tpu_budget.LANES), jnp.dtype(dtype).itemsize
    rows = tpu_budget.vmem_tile_bytes((tokens_per_step, 2 * num_kv_heads, 1, dp), item)
    return 2 * rows + 3 * tpu_budget.vmem_tile_bytes((2 * num_kv_heads, block_size, dp), item)


def write_kv_fused(
    kv_pages,  # tpu-fused [num_blocks, 2 * Hkv, block_size, Dp], or kv_quant.QuantPages of it
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]
    *,
    tokens_per_step: int = 8,
    interpret: bool = False,
):
    """New K/V into the fused layout (pallas_kernels.tpu), in place when the pages are donated;
    same contract as ``write_kv_tpu``. Under tensor parallelism each device writes its own kv
    heads (the caller runs this per shard).

    Quantized pages (QuantPages: fused int8/fp8 data, f32 scales [nb, 2 * Hkv, bs]): each (token,
    head) row is quantized as ``kv_quant.quantize`` does (the xla/cpu writes' arithmetic), the
    data moves through the same DMA kernel and the [T, 2 * Hkv] scales by one XLA scatter into
    lane ``offset`` of their page (a single-lane DMA per token would be a strided 4-byte write)."""
    if isinstance(kv_pages, QuantPages):
        (kq, ks), (vq, vs) = (quantize(x, kv_pages.dtype) for x in (k, v))
        data = write_kv_fused(kv_pages.data, kq, vq, slot_mapping, tokens_per_step=tokens_per_step,
                              interpret=interpret)
        num_blocks, kv_rows, block_size = kv_pages.scale.shape
        if slot_mapping.shape[0] == 0:
            return QuantPages(data, kv_pages.scale)
        new = jnp.stack([ks, vs], axis=2).reshape(-1, kv_rows)  # [T, 2 * Hkv]: K, V per head
        slots = slot_mapping.astype(jnp.int32)
        # one scatter of [T, 2 * Hkv] rows, in place when the pages are donated
        scale = kv_pages.scale.at[lax.div(slots, block_size), :, lax.rem(slots, block_size)].set(new)
        return QuantPages(data, scale)
    _, kv_rows, block_size, padded_dim = kv_pages.shape
    num_tokens, num_kv_heads, head_dim = k.shape
    if kv_rows != 2 * num_kv_heads or v.shape != k.shape or head_dim > padded_dim:
        raise ValueError(f"k {k.shape} / v {v.shape} do not match fused pages {kv_pages.shape}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} != ({num_tokens},)")
    if num_tokens == 0:
        return kv_pages
    new = jnp.stack([k, v], axis=2).reshape(num_tokens, kv_rows, 1, head_dim)  # K, V per head
    new = jnp.pad(new.astype(kv_pages.dtype), ((0, 0), (0, 0), (0, 0), (0, padded_dim - head_dim)))
    kernel = functools.partial(_fused_kernel, tokens_per_step=tokens_per_step,
                               block_size=block_size, num_tokens=num_tokens)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    row_spec = pl.BlockSpec((tokens_per_step, kv_rows, 1, padded_dim), lambda i, *_: (i, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(pl.cdiv(num_tokens, tokens_per_step),),
        in_specs=[any_spec, row_spec],
        out_specs=any_spec,
        scratch_shapes=[pltpu.VMEM((kv_rows, block_size, padded_dim), kv_pages.dtype),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1,), jnp.int32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={1: 0},  # operand 0 is the scalar-prefetched slots
        # in order: the page held in VMEM carries over from one step to the next
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=tpu_budget.vmem_limit(fused_vmem_estimate(
                num_kv_heads, head_dim, block_size, kv_pages.dtype, tokens_per_step))),
        interpret=compat.tpu_interpret_params() if interpret else False,
        name="write_kv_fused_tpu",
    )(slot_mapping.astype(jnp.int32), kv_pages, new)
