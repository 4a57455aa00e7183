"""The decoder's row operations fused into the native dot-product matmul (runtime/row_fusion.py,
csrc/format_matmul.h's RowFusion): the residual added exactly as XLA adds it, the RMS norm as the
model's RMSNorm computes it, on every instruction-set path here, padding rows, the XLA fallback,
and the calls' checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_kernels, quant, weight_formats
from jaxserve.runtime.row_fusion import RowNorm

WHY = cpu_kernels.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")
FORMATS = ["bfloat16", "w8a8", "w4a8", "q8a8"]
CAPS = ["auto", "avx512", "portable"]  # auto is AMX where the CPU has it, else avx512's path


def problem(seed: int, m: int, k: int, n: int, fmt: str):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)  # rows of other scales
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    norm = RowNorm(jnp.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32)), 1e-5)
    return x, jax.device_put(weight_formats.quantize(w, fmt)), residual, norm


def call(cap: str, gated: bool = False, **fused):
    isa = cpu_kernels.choose_isa(cap)
    if gated:
        return jax.jit(lambda x, w, rows, *a: quant.linear_gated(x, w, w, rows, isa=isa, **dict(zip(fused, a))))
    return jax.jit(lambda x, w, rows, *a: quant.linear(x, w, rows, isa=isa, **dict(zip(fused, a))))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("m,rows", [(1, 1), (7, 5), (113, 100)])
def test_residual_is_the_xla_add(fmt, cap, m, rows):
    """y = residual + x @ W bit for bit as XLA adds the product to it (a float32 add), row tiles
    and work items of every size; the rows past the call's real rows are the residual's (as
    residual + 0)."""
    x, w, residual, _ = problem(m, m, 576, 192, fmt)
    r = jnp.asarray([rows], jnp.int32)
    plain = np.asarray(call(cap)(x, w, r))
    fused = np.asarray(call(cap, residual=None)(x, w, r, residual))
    np.testing.assert_array_equal(fused, residual + plain)
    np.testing.assert_array_equal(fused[rows:], residual[rows:])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cap", CAPS)
def test_norm_is_the_models_rms_norm(fmt, cap):
    """The rows normed in the call give what the product of XLA's normed rows gives, to the norm's
    last bit: its float32 sum runs in another order than XLA's. bfloat16 activations absorb that
    bit but for a rare one rounded the other way (measured: 99% of rows bit-identical, the largest
    difference 2.5e-4 of the largest output); the int8 formats' block scales carry it into every
    output (~1e-7 relative)."""
    m = 113
    x, w, residual, norm = problem(7, m, 576, 1536, fmt)
    r = jnp.asarray([m], jnp.int32)
    for gated in (False, True):
        want = np.asarray(call(cap, gated)(np.asarray(norm(jnp.asarray(x))), w, r))
        got = np.asarray(call(cap, gated, norm=None)(x, w, r, norm))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3 * np.abs(want).max())
        same_rows = (got == want).all(axis=1).mean()
        assert fmt != "bfloat16" or same_rows >= 0.9, f"only {same_rows:.0%} of rows bit-identical"
    both = np.asarray(call(cap, norm=None, residual=None)(x, w, r, norm, residual))
    alone = np.asarray(call(cap, norm=None)(x, w, r, norm))
    np.testing.assert_array_equal(both, residual + alone)


@pytest.mark.parametrize("fmt", ["bfloat16", "w8a8"])
def test_the_xla_path_applies_them_as_ops(fmt):
    """Off the native kernel (native=False: the xla backend, accelerators) the norm and residual
    are the XLA ops the model ran before: RowNorm first, the add after."""
    x, w, residual, norm = problem(3, 9, 576, 192, fmt)
    fused = jax.jit(lambda x, w, n, res: quant.linear(x, w, native=False, norm=n, residual=res))
    apart = jax.jit(lambda x, w, n, res: res + quant.linear(n(x), w, native=False))
    np.testing.assert_array_equal(np.asarray(fused(x, w, norm, residual)), np.asarray(apart(x, w, norm, residual)))


def test_the_model_norm_is_row_norm():
    """model/layers.py's RMSNorm applies the RowNorm it hands the linear layers (Gemma: 1 + w)."""
    from jaxserve.model.layers import RMSNorm

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    for offset in (False, True):
        mod = RMSNorm(1e-6, jnp.float32, offset)
        params = {"params": {"weight": jnp.linspace(-0.5, 0.5, 64)}}
        norm = mod.apply(params, x, apply=False)
        assert isinstance(norm, RowNorm)
        np.testing.assert_array_equal(np.asarray(mod.apply(params, x)), np.asarray(norm(x)))
        scale = 1.0 + params["params"]["weight"] if offset else params["params"]["weight"]
        np.testing.assert_array_equal(np.asarray(norm.scale), np.asarray(scale))


def test_calls_check_the_fused_operands():
    """A residual not [M, N], a norm not [K], or either given to the quantized kernel (whose tiles
    read x's rows in place: it fuses neither) is an error naming what is expected."""
    from jaxserve.runtime.compat import ffi

    x, w, residual, norm = problem(1, 8, 64, 64, "bfloat16")
    fmt = weight_formats.format_of(w)
    isa = np.int32(cpu_kernels.choose_isa("auto")["bfloat16"])
    rows = jnp.asarray([8], jnp.int32)
    out = jax.ShapeDtypeStruct((8, 64), jnp.float32)

    def dot(norm_op, res_op):
        return ffi.ffi_call("jaxserve_dot_matmul", out)(x, *fmt.operands(w), rows, norm_op, res_op,
                                                        format=np.int32(fmt.id), eps=np.float32(1e-5), isa=isa)

    empty = jnp.zeros((0,), jnp.float32)
    with pytest.raises(Exception, match=r"expected norm f32\[K\] and residual f32\[M, N\] or empty"):
        jax.block_until_ready(dot(empty, jnp.zeros((8, 32), jnp.float32)))
    with pytest.raises(Exception, match=r"expected norm f32\[K\]"):
        jax.block_until_ready(dot(jnp.ones((32,), jnp.float32), empty))
    np.testing.assert_array_equal(np.asarray(dot(empty, residual)), np.asarray(quant.linear(x, w, 8)) + residual)

    q = jax.device_put(weight_formats.quantize(np.ones((64, 64), np.float32), "int8"))
    qfmt = weight_formats.format_of(q)
    with pytest.raises(Exception, match="quant matmul: expected norm .* empty \\(this kernel fuses neither\\)"):
        jax.block_until_ready(ffi.ffi_call("jaxserve_quant_matmul", out)(
            x, *qfmt.operands(q), rows, empty, residual, format=np.int32(qfmt.id), eps=np.float32(0)))
