"""The TPU grouped matmul (pallas_kernels/tpu_gmm.py) in Pallas' TPU interpreter against
`jax.lax.ragged_dot`: empty groups, one group holding every row, tiles straddling groups, M not a
multiple of the row tile, K and N split over several blocks, rows past the groups' sum (zeros, or
left alone with ``zero_rest=False``), bf16 and f32; then the MoE block's grouped experts through it
(`runtime/moe.pallas_ragged_dot`, what the TPU backend runs) with padded NaN rows and an expert
slice, and the tile sizes chosen for Qwen3-30B-A3B's experts. Kept small: the interpreter walks
every grid step in Python."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.backend import resolve_backend
from jaxserve.runtime.moe import gpu_ragged_dot, grouped_experts, pallas_ragged_dot
from pallas_kernels import tpu_budget, tpu_gmm

TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def operands(m, k, n, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def check(got, lhs, rhs, sizes, rows=None):
    want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    got = np.asarray(got.astype(jnp.float32))
    rows = got.shape[0] if rows is None else rows
    tol = TOL[jnp.dtype(lhs.dtype).name]
    np.testing.assert_allclose(got[:rows], np.asarray(want)[:rows], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tiles,zero_rest", [("float32", tpu_gmm.Tiles(8, 128, 128), True),
                                                    ("bfloat16", None, False)])
def test_gmm_matches_ragged_dot(dtype, tiles, zero_rest):
    """37 rows (not whole tiles), groups of 0, 13, 0, 20, 0 rows (13 ends inside a tile) and 4
    rows past the sum: zeros (f32, with K and N in two blocks each), or left alone
    (``zero_rest=False``, bf16: the groups' rows are right, the rest is the caller's to ignore)."""
    lhs, rhs, sizes = operands(37, 256, 256, [0, 13, 0, 20, 0], dtype)
    got = tpu_gmm.gmm(lhs, rhs, sizes, tiles=tiles, zero_rest=zero_rest, interpret=True)
    assert got.shape == (37, 256) and got.dtype == lhs.dtype
    check(got, lhs, rhs, sizes, rows=None if zero_rest else 33)
    if zero_rest:
        assert np.all(np.asarray(got[33:]) == 0)


def test_gmm_one_group_holds_every_row_and_all_empty():
    lhs, rhs, sizes = operands(24, 128, 128, [0, 24, 0], "float32", seed=1)
    check(tpu_gmm.gmm(lhs, rhs, sizes, interpret=True), lhs, rhs, sizes)
    empty = tpu_gmm.gmm(lhs, rhs, jnp.zeros((3,), jnp.int32), interpret=True)
    assert np.all(np.asarray(empty) == 0)


def test_group_metadata_visits():
    """Tiles of 8 rows, groups of 0, 13, 0, 20 rows and 7 past the sum: tile 1 holds rows of
    groups 1 and 3, tile 4 of group 3 and the rest (group 4)."""
    md = jax.jit(tpu_gmm.group_metadata, static_argnums=(1, 2, 3))(jnp.asarray([0, 13, 0, 20], jnp.int32), 40, 8, True)
    n = int(md.num_visits[0])
    assert list(zip(np.asarray(md.group_ids)[:n], np.asarray(md.tile_ids)[:n])) == [
        (1, 0), (1, 1), (3, 1), (3, 2), (3, 3), (3, 4), (4, 4)]
    assert np.asarray(md.offsets).tolist() == [0, 0, 13, 13, 33, 40]
    assert md.group_ids.shape == (5 + 4,)  # cdiv(40, 8) + E grid steps
    assert np.all(np.asarray(md.tile_ids)[n:] == 4)  # past the count: the last visit again


def test_grouped_experts_through_the_kernel():
    """The MoE block's product as the TPU backend runs it: NaN bucket padding never routed, and one
    device's slice of the experts (expert parallelism) with the others' rows in the sentinel."""
    h, i, e, k, t = 128, 128, 8, 2, 13
    rng = np.random.default_rng(3)
    x = rng.standard_normal((t, h)).astype(np.float32)
    x[10:] = np.nan
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    wg, wu, wd = (jnp.asarray(rng.normal(0, 0.1, s), jnp.float32) for s in ((e, h, i), (e, h, i), (e, i, h)))
    rows = jnp.asarray([10], jnp.int32)
    run = jax.jit(functools.partial(grouped_experts, matmul=functools.partial(pallas_ragged_dot, interpret=True)),
                  static_argnames=("expert_offset", "num_experts"))
    ref = jax.jit(grouped_experts, static_argnames="expert_offset")
    got = np.asarray(run(jnp.asarray(x), ids, w, wg[4:], wu[4:], wd[4:], rows, expert_offset=4, num_experts=e))
    want = np.asarray(ref(jnp.asarray(x), ids, w, wg[4:], wu[4:], wd[4:], rows, expert_offset=4))
    assert np.all(got[10:] == 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [64, 512])
def test_tile_sizes_for_qwen3_30b_a3b(tokens):
    """Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, 128 experts, top-8) in bf16:
    (sublane, lane)-aligned blocks that divide the product and fit the budget."""
    m = tokens * 8
    for k, n in ((2048, 768), (768, 2048)):
        t = tpu_gmm.tile_sizes(m, k, n, 128, jnp.bfloat16)
        assert t.tm % 16 == 0 and t.tm <= tpu_gmm.MAX_TM
        assert k % t.tk == 0 and n % t.tn == 0 and t.tk % 128 == 0 and t.tn % 128 == 0
        assert tpu_gmm.vmem_estimate(t, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16) <= tpu_gmm.BLOCK_VMEM_BYTES
    assert tpu_budget.vmem_limit(tpu_gmm.BLOCK_VMEM_BYTES) <= tpu_budget.MIN_VMEM_BYTES
    # expert parallel over 8: 16 experts a device, but an expert's rows are still tokens * 8 / 128
    assert tpu_gmm.tile_sizes(m, 2048, 768, 16, jnp.bfloat16, group_rows=m // 128).tm == max(16, m // 128)


def test_tpu_backend_runs_the_kernel():
    tpu = resolve_backend(None, "bfloat16", "bfloat16", target="tpu")
    assert tpu._float_ops(lambda f: f).moe.keywords["matmul"] is pallas_ragged_dot
    gpu = resolve_backend(None, "bfloat16", "bfloat16", target="gpu", compute_capability="9.0")
    assert gpu._float_ops(lambda f: f).moe.keywords["matmul"] is gpu_ragged_dot  # tests/kernels/test_gpu_gmm.py


def test_gmm_lowers_for_tpu_at_qwen3_30b_a3b_down():
    """The Pallas -> Mosaic TPU lowering (jax.export, no libtpu) of the down projection at T512:
    the blocks pass Pallas' (8, 128) checks; the compile tier runs Mosaic's own passes."""
    from jaxserve.runtime import compat

    shapes = (jax.ShapeDtypeStruct((4096, 768), jnp.bfloat16), jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
              jax.ShapeDtypeStruct((128,), jnp.int32))
    text = compat.export(jax.jit(tpu_gmm.gmm), platforms=["tpu"])(*shapes).mlir_module()
    assert "tpu_custom_call" in text and "gmm_tpu" in text
