"""Routed experts kept in a weight format (runtime/expert_matmul.py): the native grouped call over
rows sorted by expert gives, row for row and bit for bit, what the dense native kernel of the same
format gives on that expert's weight (plain and gated, every format of the registry; experts with
no rows; rows past the groups zero even where they hold NaN), and the xla path's tiled product
agrees with the dense xla path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_kernels, quant, weight_formats
from jaxserve.runtime.expert_matmul import grouped_gated, grouped_matmul
from jaxserve.runtime.weight_formats import FORMATS, ExpertStack, expert_at, stack_experts
from jaxserve.runtime.weight_formats import quantize as quantize_weight

K, N, E = 256, 128, 4  # K in whole K-quant super-blocks
SIZES = [5, 0, 7, 1]  # 13 rows of 16: expert 1 has none, three padded rows
M = 16

pytestmark = pytest.mark.skipif(cpu_kernels.available() is not None, reason="native CPU kernels unavailable")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[sum(SIZES):] = np.nan  # rows past the groups are never read
    ws = [rng.standard_normal((E, K, N)).astype(np.float32) * 0.05 for _ in range(2)]
    return jnp.asarray(x), ws


def stacked(ws, name) -> ExpertStack:
    s = stack_experts([quantize_weight(w, name) for w in ws])
    return ExpertStack(type(s.w)(*map(jnp.asarray, s.w)))


def per_expert(fn, x, *stacks):
    """fn(rows, *expert weights) group by group, zeros after the groups."""
    out, start = [], 0
    for e, n in enumerate(SIZES):
        if n:
            out.append(np.asarray(fn(x[start:start + n], *(expert_at(s.w, e) for s in stacks))))
        start += n
    out.append(np.zeros((M - start, N), np.float32))
    return np.concatenate(out)


@pytest.mark.parametrize("name", [f.name for f in FORMATS])
def test_grouped_equals_dense_per_expert(data, name):
    x, (wg, wu) = data
    g, u = stacked(wg, name), stacked(wu, name)
    sizes = jnp.asarray(SIZES, jnp.int32)
    isa = cpu_kernels.choose_isa()
    got = np.asarray(jax.jit(lambda x, g, s: grouped_matmul(x, g, s, native=True, isa=isa))(x, g, sizes))
    want = per_expert(lambda r, w: quant.linear(r, w, native=True, isa=isa), x, g)
    np.testing.assert_array_equal(got, want)
    got = np.asarray(jax.jit(lambda x, g, u, s: grouped_gated(x, g, u, s, native=True, isa=isa))(x, g, u, sizes))
    want = per_expert(lambda r, a, b: quant.linear_gated(r, a, b, native=True, isa=isa), x, g, u)
    np.testing.assert_array_equal(got, want)
    if name not in ("q4_k", "w4a8", "bfloat16"):  # the xla path (generic: one format per kernel family)
        return
    # the xla path: each tile times its expert as the dense xla path computes it
    xla = np.asarray(jax.jit(lambda x, g, s: grouped_matmul(x, g, s, native=False))(x, g, sizes))
    ref = per_expert(lambda r, w: quant.linear(r, w, native=False), x, g)
    np.testing.assert_allclose(xla[:sum(SIZES)], ref[:sum(SIZES)], rtol=1e-5, atol=1e-5)


def test_mxfp4_kernel_exact_against_numpy():
    """MXFP4 in panels (csrc/quant_matmul.cc kMXFP4, decoded in registers) against numpy's float64
    product of mxfp4.decode_numpy's values at every row count 1..113 (issue 28's reference): one
    113-row executable given `num_rows` real rows (as the engine runs its padded buckets: the kernel
    tiles only those rows, the rest come out zero), and 1, 7 and 113 rows as their own shapes. Every
    value and product is exact in float32, so only the float32 sums' rounding differs."""
    from jaxserve.runtime import mxfp4

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((1, K, N)) * np.exp2(rng.integers(-6, 3, (1, 1, N)))).astype(np.float32)
    hf = mxfp4.quantize(w)
    dense = np.swapaxes(mxfp4.decode_numpy(hf.blocks[0], hf.scales[0]), 0, 1)  # [K, N] float64
    panels = mxfp4.to_panels(hf.blocks[0], hf.scales[0])
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(panels)), dense)
    w = type(panels)(*map(jnp.asarray, panels))
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(dense).max())
    for m in (1, 7, 113):
        x = rng.standard_normal((m, K)).astype(np.float32)
        got = np.asarray(quant.linear(jnp.asarray(x), w, native=True))
        np.testing.assert_allclose(got, x.astype(np.float64) @ dense, **tol)
    x = rng.standard_normal((113, K)).astype(np.float32)
    want = x.astype(np.float64) @ dense
    run = jax.jit(lambda x, w, n: quant.linear(x, w, n, native=True))
    for m in range(1, 114):
        got = np.asarray(run(x, w, jnp.array([m], jnp.int32)))
        np.testing.assert_allclose(got[:m], want[:m], err_msg=f"{m} rows", **tol)
        assert not got[m:].any(), f"{m} rows: rows past num_rows must be zero"
