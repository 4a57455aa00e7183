"""The GPU grouped matmul (pallas_kernels/gpu_gmm.py) in Pallas' Mosaic GPU interpreter against
`jax.lax.ragged_dot`: empty groups, one group holding every row, 64-row tiles straddling groups, M
not a multiple of the tile, K over several pipeline stages, rows past the groups' sum (zeros, or
left alone with ``zero_rest=False``); the MoE block through `runtime/moe.gpu_ragged_dot` (what the
cuda backend runs) with an expert slice; the backend's choice; and the lowering for cuda (jax.export,
no ptxas) at Qwen3-30B-A3B's expert shapes. Kept small: the interpreter walks every CTA in Python."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.backend import resolve_backend
from jaxserve.runtime.moe import gpu_ragged_dot, grouped_experts
from pallas_kernels import gpu_gmm


def operands(m, k, n, sizes, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def check(got, lhs, rhs, sizes, rows=None):
    want = np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32))
    got = np.asarray(got.astype(jnp.float32))
    rows = got.shape[0] if rows is None else rows
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("zero_rest", [True, False])
def test_gmm_matches_ragged_dot(zero_rest):
    """100 rows (tiles of 64: not whole), groups of 0, 13, 0, 70, 0 rows (13 ends inside tile 0,
    70 straddles tiles 0 and 1) and 17 rows past the sum: zeros, or left alone (the caller's);
    K of 128 in 4 blocks of 32 through 2 stages (the ring wraps), N in 2 blocks of 16."""
    lhs, rhs, sizes = operands(100, 128, 32, [0, 13, 0, 70, 0])
    got = gpu_gmm.gmm(lhs, rhs, sizes, tiles=gpu_gmm.Tiles(32, 16, 2), zero_rest=zero_rest, interpret=True)
    assert got.shape == (100, 32) and got.dtype == lhs.dtype
    check(got, lhs, rhs, sizes, rows=None if zero_rest else 83)
    if zero_rest:
        assert np.all(np.asarray(got[83:]) == 0)


def test_gmm_one_group_holds_every_row_and_all_empty():
    lhs, rhs, sizes = operands(64, 64, 16, [0, 64, 0], seed=1)
    check(gpu_gmm.gmm(lhs, rhs, sizes, interpret=True), lhs, rhs, sizes)
    empty = gpu_gmm.gmm(lhs, rhs, jnp.zeros((3,), jnp.int32), interpret=True)
    assert np.all(np.asarray(empty) == 0)


def test_grouped_experts_through_the_kernel():
    """The MoE block as the cuda backend runs it, on one device's slice of the experts (expert
    parallelism: the others' rows in the sentinel group, never visited) with padded NaN rows."""
    h, i, e, k, t = 64, 32, 4, 2, 9
    rng = np.random.default_rng(3)
    x = rng.standard_normal((t, h)).astype(np.float32)
    x[7:] = np.nan
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    wg, wu, wd = (jnp.asarray(rng.normal(0, 0.1, s), jnp.bfloat16) for s in ((e, h, i), (e, h, i), (e, i, h)))
    rows = jnp.asarray([7], jnp.int32)
    xb = jnp.asarray(x, jnp.bfloat16)
    run = jax.jit(functools.partial(grouped_experts, matmul=functools.partial(gpu_ragged_dot, interpret=True)),
                  static_argnames=("expert_offset", "num_experts"))
    ref = jax.jit(grouped_experts, static_argnames="expert_offset")
    got = np.asarray(run(xb, ids, w, wg[2:], wu[2:], wd[2:], rows, expert_offset=2, num_experts=e), np.float32)
    want = np.asarray(ref(xb, ids, w, wg[2:], wu[2:], wd[2:], rows, expert_offset=2), np.float32)
    assert np.all(got[7:] == 0)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


def test_unsupported_operands_take_xla():
    """f32 experts (or K / N not multiples of 16) are XLA's ragged_dot: same result, no kernel."""
    lhs, rhs, sizes = operands(20, 24, 16, [5, 15], dtype=jnp.float32)
    assert gpu_gmm.unsupported(24, 16, jnp.float32, jnp.float32)
    np.testing.assert_array_equal(np.asarray(gpu_ragged_dot(lhs, rhs, sizes)),
                                  np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)))


def test_cuda_backend_runs_the_kernel_on_hopper_only():
    hopper = resolve_backend(None, "bfloat16", "bfloat16", target="gpu", compute_capability="9.0")
    assert hopper._float_ops(lambda f: f).moe.keywords["matmul"] is gpu_ragged_dot
    for other in (resolve_backend("xla", "bfloat16", "bfloat16", target="gpu", compute_capability="9.0"),
                  resolve_backend(None, "bfloat16", "bfloat16", target="gpu", compute_capability="8.0")):
        assert not other.gpu_moe_kernel and other._float_ops(lambda f: f).moe is grouped_experts


@pytest.mark.parametrize("k,n,e,tiles", [(2048, 768, 128, (64, 128)), (768, 2048, 16, (64, 128)),
                                         (2048, 96, 128, (64, 32)), (96, 2048, 128, (32, 128))])
def test_gmm_lowers_for_cuda_at_qwen3_30b_a3b(k, n, e, tiles):
    """The Pallas -> Mosaic GPU lowering (jax.export from this CPU host, no ptxas) of Qwen3-30B-A3B's
    gate/up at T512 over all 128 experts, its down projection over an EP 8 slice, and both at TP 8
    (I / 8 = 96: narrower blocks, a 64-byte swizzle); the compile tier (``cuda/*/gmm/*``) runs ptxas."""
    from jaxserve.runtime import compat

    shapes = (jax.ShapeDtypeStruct((4096, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16),
              jax.ShapeDtypeStruct((e,), jnp.int32))
    fn = functools.partial(gpu_gmm.gmm, zero_rest=e == 128)
    text = compat.export(jax.jit(fn), platforms=["cuda"])(*shapes).mlir_module()
    assert "mosaic_gpu_v2" in text
    t = gpu_gmm.tile_sizes(k, n, jnp.bfloat16)
    assert (t.tk, t.tn) == tiles and gpu_gmm.smem_bytes(t, 2) <= gpu_gmm.SMEM_BUDGET
