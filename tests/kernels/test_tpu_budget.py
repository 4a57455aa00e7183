"""The TPU kernels' VMEM/SMEM budgets, and (with libtpu installed) a real Mosaic TPU compile.

The budget checks are arithmetic (no kernel runs). The compile tests run only where libtpu is
importable (``pip install 'jax[tpu]'``): jax's deviceless compile for a v5e topology, which is
what ``bench/tpu_kernel_compile.py`` runs for every shape.
"""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import compile_check, tpu, tpu_budget, tpu_cases

MiB = 1 << 20


def test_vmem_limit_covers_the_estimate_and_fits_every_chip():
    for case in tpu_cases.cases():
        assert case.vmem_estimate < case.vmem_limit <= tpu_budget.MIN_VMEM_BYTES, case
        assert all(tpu_budget.check(case.vmem_limit, chip) is None for chip in tpu_budget.CHIPS)
        assert case.smem_bytes <= tpu_budget.SMEM_BYTES, case
    with pytest.raises(ValueError, match="exceeds the 64 MiB of VMEM"):
        tpu_budget.vmem_limit(65 * MiB)


def test_many_head_prefill_asks_past_the_v5e_default():
    """32 kv heads (no GQA), head_dim 128: ~14 MiB of buffers, near v5e's 16 MiB scoped default;
    the call asks for its estimate plus headroom instead of relying on the default."""
    sizes = tpu.block_sizes(False, 1, 16, num_kv_heads=32, head_dim=128)
    est = tpu.vmem_estimate(num_kv_heads=32, rows=128, head_dim=128, q_dtype=jnp.bfloat16,
                            kv_dtype=jnp.bfloat16, block_size=16, pages_per_chunk=sizes["pages_per_chunk"])
    assert 12 * MiB < est < tpu_budget.vmem_limit(est)
    assert tpu_budget.vmem_limit(est) > tpu_budget.CHIPS["v5e"].vmem_scoped


def test_block_tables_split_to_stay_in_smem():
    assert tpu.table_rows(64, 256) == 64  # 64 KiB: one call
    assert tpu.table_rows(256, 8192) == 16  # 128k context x 256 sequences: 16 calls of 16
    assert tpu.smem_estimate(num_seqs=256, max_blocks=8192, num_tiles=256) <= tpu_budget.SMEM_BYTES
    with pytest.raises(ValueError, match="block size or a shorter max_model_len"):
        tpu.table_rows(8, 1 << 20)


def test_kernels_package_imports_nothing_from_jaxserve():
    code = ("import sys, pallas_kernels, pallas_kernels.tpu, pallas_kernels.kv_write, pallas_kernels.gpu, "
            "pallas_kernels.gpu_decode, pallas_kernels.tpu_cases; "
            "print([m for m in sys.modules if m.split('.')[0] == 'jaxserve'])")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install 'jax[tpu]')")


@needs_libtpu
def test_decode_attention_and_write_compile_for_v5e():
    for case in (tpu_cases.attention_case("smollm2-135m", "T1 S1 decode", "bf16", 1),
                 tpu_cases.write_case("smollm2-135m", 1, "bf16", 1)):
        r = tpu_cases.run(case, "v5e:2x2")
        assert r["ok"], r["detail"]


@needs_libtpu
def test_a_sub_tile_dma_fails_to_compile():
    """What the fused write used to do: DMA one token row out of a page's (16, 128) bf16 tile."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(slot_ref, new_ref, pages_in, pages_out, sem):
        del pages_in
        cp = pltpu.make_async_copy(new_ref, pages_out.at[0, :, pl.ds(slot_ref[0], 1)], sem.at[0])
        cp.start()
        cp.wait()

    def fn(slot, new, pages):
        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), any_spec],
                out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
            input_output_aliases={2: 0})(slot, new, pages)

    s = jax.ShapeDtypeStruct
    r = compile_check.tpu_compile_check(fn, (s((1,), jnp.int32), s((4, 1, 128), jnp.bfloat16),
                                             s((8, 4, 16, 128), jnp.bfloat16)), "v5e:2x2")
    assert not r["ok"] and "aligned to tiles" in r["detail"]
