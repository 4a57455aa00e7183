"""MXFP4 x int8 activations (runtime/mxfp4.py's Mxfp4A8Weight, csrc/dot_matmul.cc kMXFP4A8, issue 28):
the native kernel, bit for bit, against a numpy reference of the same arithmetic (the activations'
int8 blocks, 2 e2m1 as integers, each block's exact integer sum times 2^(e - 128) sx in float32,
added block by block) on every instruction path this machine has (AMX tiles, VNNI, portable) at
1..113 rows, plain and gated; the layout against the exact MXFP4 panels; the xla path against the
native one. The grouped expert call (experts without rows) runs in tests/kernels/test_expert_matmul.py,
which takes every format of the registry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_isa, cpu_kernels, mxfp4, panels, quant, weight_formats

WHY = cpu_kernels.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")
K, N = 256, 128
ROWS = (1, 7, 16, 40, 113)  # AMX: a few rows on isa 1, a whole tile, partial tiles, two work items


def weights(seed: int):
    """MXFP4 panels of a [K, N] matrix with exponents spread over columns, and its Mxfp4A8Weight."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * np.exp2(rng.integers(-8, 3, (1, N)))).astype(np.float32)
    exact = mxfp4.quantize_panels(w)
    return exact, mxfp4.to_a8(exact)


def reference(x: np.ndarray, exact: mxfp4.Mxfp4Panels) -> np.ndarray:
    """kMXFP4A8's arithmetic in numpy, float32 where the kernel rounds: xq, sx as the kernel
    quantizes a block; sum(xq 2 e2m1(c)) exact; t = float32(sum) * (2^(e - 128) sx); y = sum of t in
    block order."""
    xq, _ = weight_formats.quantize_blocks(x, np)  # [M, K] int8 values
    # the block scale max |x| / 127 as -ffast-math compiles it: times the float32 reciprocal of 127
    sx = np.abs(x.reshape(x.shape[0], -1, 32)).max(axis=2) * np.float32(1 / 127)
    codes = panels.from_panels(panels.nibbles(np.asarray(exact.q)))  # [K, N] 0..15
    w2 = (2 * np.asarray(mxfp4.E2M1))[codes].astype(np.int64)  # -12..12
    scale = np.exp2(panels.from_panels(np.asarray(exact.e)).astype(np.float64) - 128).astype(np.float32)  # [K/32, N]
    m, blocks = x.shape[0], K // 32
    sums = np.einsum("mbk,bkn->mbn", xq.astype(np.int64).reshape(m, blocks, 32), w2.reshape(blocks, 32, N))
    y = np.zeros((m, N), np.float32)
    for b in range(blocks):
        y = y + sums[:, b].astype(np.float32) * (scale[b] * sx[:, b:b + 1])
    return y


def test_layout_is_the_exact_panels_bytes():
    """Mxfp4A8Weight holds the same codes and exponents: it decodes to the exact panels' values,
    rows and whole matrix, at 4.25 bits a weight."""
    exact, a8 = weights(0)
    want = np.asarray(weight_formats.dequantize(exact))
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(a8)), want)
    ids = jnp.asarray([0, 5, 64, 127])
    rows = weight_formats.format_of(a8).embed_rows(a8, ids // 64, ids % 64, ids)
    np.testing.assert_array_equal(np.asarray(rows), want.T[np.asarray(ids)])
    assert sum(a.nbytes for a in a8) * 8 / (K * N) == mxfp4.BITS_PER_WEIGHT


CAPS = ["auto", "avx512", "portable"]


@pytest.mark.parametrize("cap", CAPS)
def test_kernel_bit_exact_against_numpy(cap):
    """Every isa this machine reaches (auto: AMX where Linux grants it; avx512: VNNI; portable)
    gives the reference's bits, plain and gated (silu(g) u of the two), at 1, 7, 16, 40 and 113 rows
    as their own shapes and at every row count 1..113 in one 113-row executable given `num_rows`
    real rows (as the engine runs its padded buckets: the kernel tiles only those rows, the rest
    come out zero); a zero block and a zero row included."""
    isa = cpu_kernels.choose_isa(cap)
    if cap == "avx512" and "avx512_vnni" not in cpu_isa.cpu_features():
        pytest.skip("no AVX512_VNNI: avx512 is the portable path here")
    if cap == "auto" and "amx_int8" in cpu_isa.cpu_features() and cpu_kernels.amx_permitted() is None:
        assert isa["mxfp4a8"] == 2  # AMX tiles here
    exact, a8 = weights(1)
    _, up = weights(2)
    a8, up = (type(w)(*map(jnp.asarray, w)) for w in (a8, up))
    lin = jax.jit(lambda x, w: quant.linear(x, w, native=True, isa=isa))
    gat = jax.jit(lambda x, w, u: quant.linear_gated(x, w, u, native=True, isa=isa))
    rng = np.random.default_rng(3)
    for m in ROWS:
        x = rng.standard_normal((m, K)).astype(np.float32)
        x[:, 32:64] = 0
        x[m // 2] = 0
        want = reference(x, exact)
        np.testing.assert_array_equal(np.asarray(lin(x, a8)), want, err_msg=f"{cap}, {m} rows")
        g = np.asarray(gat(x, a8, up))
        u = reference(x, mxfp4.quantize_panels(np.asarray(weight_formats.dequantize(up)))).astype(np.float64)
        silu = want * u / (1 + np.exp(-want.astype(np.float64)))
        np.testing.assert_allclose(g, silu, rtol=1e-5, atol=1e-6 * np.abs(want * u).max())
    m_max = ROWS[-1]
    x = rng.standard_normal((m_max, K)).astype(np.float32)
    x[:, 64:96] = 0
    x[[2, 57]] = 0
    want = reference(x, exact)
    u = reference(x, mxfp4.quantize_panels(np.asarray(weight_formats.dequantize(up)))).astype(np.float64)
    silu = want * u / (1 + np.exp(-want.astype(np.float64)))
    lin_n = jax.jit(lambda x, w, n: quant.linear(x, w, n, native=True, isa=isa))
    gat_n = jax.jit(lambda x, w, u, n: quant.linear_gated(x, w, u, n, native=True, isa=isa))
    for m in range(1, m_max + 1):
        n = jnp.array([m], jnp.int32)
        y = np.asarray(lin_n(x, a8, n))
        np.testing.assert_array_equal(y[:m], want[:m], err_msg=f"{cap}, {m} of {m_max} rows")
        g = np.asarray(gat_n(x, a8, up, n))
        np.testing.assert_allclose(g[:m], silu[:m], rtol=1e-5, atol=1e-6 * np.abs(want[:m] * u[:m]).max(),
                                   err_msg=f"{cap}, gated, {m} of {m_max} rows")
        assert not y[m:].any() and not g[m:].any(), f"{cap}, {m} rows: rows past num_rows must be zero"


def test_isa_paths_and_xla_agree():
    """The paths' bits are equal (integer block sums); the xla path (dequantized weights times the
    activations' int8 blocks) agrees to float32 rounding; and all stay within the activations'
    int8 rounding of the exact float32 MXFP4 kernel (Mxfp4Panels)."""
    exact, a8 = weights(4)
    x = np.random.default_rng(5).standard_normal((33, K)).astype(np.float32)
    w = type(a8)(*map(jnp.asarray, a8))
    def native(cap):
        isa = cpu_kernels.choose_isa(cap)
        return np.asarray(jax.jit(lambda x, w: quant.linear(x, w, native=True, isa=isa))(x, w))

    outs = [native(cap) for cap in CAPS]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    xla = np.asarray(jax.jit(lambda x, w: quant.linear(x, w, native=False))(x, w))
    scale = np.abs(outs[0]).max()
    np.testing.assert_allclose(xla, outs[0], atol=1e-5 * scale)
    f32 = np.asarray(quant.linear(jnp.asarray(x), type(exact)(*map(jnp.asarray, exact)), native=True))
    # int8 per block of 32: each activation within 0.5 / 127 of its block's max; over K = 256
    # random-sign terms the error is ~1e-3 of the output scale
    assert np.abs(outs[0] - f32).max() <= 1e-2 * scale


def test_quantization_needs_mxfp4_experts():
    """--quantization mxfp4a8 lays out a checkpoint's MXFP4 experts; a model without them, or tensor
    parallelism, is told so (not silently run unquantized)."""
    from jaxserve.errors import UserError
    from jaxserve.runtime.quant_params import quantize_params
    from jaxserve.runtime.weight_formats import ExpertStack

    with pytest.raises(UserError, match="MXFP4 experts"):
        quantize_params({"mlp": {"kernel": np.zeros((64, 64), np.float32)}}, "mxfp4a8")
    experts = mxfp4.quantize(np.ones((2, 64, 64), np.float32))
    with pytest.raises(UserError, match="tensor_parallel_size 1"):
        quantize_params({"experts": {"gate_proj": experts}}, "mxfp4a8", experts=False)
    out = quantize_params({"experts": {"gate_proj": experts}, "kernel": np.ones((64, 64))}, "mxfp4a8")
    assert isinstance(out["experts"]["gate_proj"], ExpertStack) and out["kernel"].dtype == np.float64
    np.testing.assert_array_equal(np.asarray(out["experts"]["gate_proj"].expert(1)), np.ones((64, 64)))
    # jaxserve lower: shapes only, the same as the real layout's
    shapes = mxfp4.Mxfp4Weight(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in experts))
    abstract = quantize_params({"experts": {"gate_proj": shapes}}, "mxfp4a8")["experts"]["gate_proj"]
    assert [(a.shape, a.dtype) for a in abstract.w] == [(a.shape, a.dtype) for a in out["experts"]["gate_proj"].w]


def test_grouped_call_on_whole_tiles():
    """The grouped expert call with experts of 0, 40 and 17 rows (AMX: whole and partial 16-row
    tiles, where the CPU has them) gives each expert's rows the dense call's bits on that expert."""
    from jaxserve.runtime.expert_matmul import grouped_gated
    from jaxserve.runtime.weight_formats import ExpertStack, expert_at, stack_experts

    isa = cpu_kernels.choose_isa()
    sizes = [0, 40, 17]
    g, u = (ExpertStack(type(s.w)(*map(jnp.asarray, s.w))) for s in
            (stack_experts([weights(10 * j + i)[1] for i in range(3)]) for j in range(2)))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((64, K)), jnp.float32)
    got = np.asarray(jax.jit(lambda x, g, u, s: grouped_gated(x, g, u, s, native=True, isa=isa))(
        x, g, u, jnp.asarray(sizes, jnp.int32)))
    dense = jax.jit(lambda x, a, b: quant.linear_gated(x, a, b, native=True, isa=isa))
    np.testing.assert_array_equal(got[:40], np.asarray(dense(x[:40], expert_at(g.w, 1), expert_at(u.w, 1))))
    np.testing.assert_array_equal(got[40:57], np.asarray(dense(x[40:57], expert_at(g.w, 2), expert_at(u.w, 2))))
    assert not got[57:].any()
