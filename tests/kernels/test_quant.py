"""Quantized weights (jaxserve/runtime/quant.py, csrc/quant_matmul.cc): quantize -> dequantize
against the reference arithmetic, GGUF blocks read exactly as the `gguf` package dequantizes
them, the native kernel (plain and gated) against float64 over the dequantized weight, its rows
independent of the batch, padding rows zero, the embedding gather, and the XLA fallback."""

from __future__ import annotations

import gguf
import ml_dtypes
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.errors import UserError
from jaxserve.runtime import cpu_kernels, panels, quant, quant_params, weight_formats

WHY = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")
RNG = np.random.default_rng(0)
FORMATS = ["int8", "fp8", "Q8_0", "Q4_0", "Q4_1"]


def gguf_bytes(type_name: str, w_out_in: np.ndarray) -> np.ndarray:
    """A float [N, K] matrix quantized by the `gguf` package: raw bytes (N, bytes per row)."""
    return gguf.quants.quantize(w_out_in.astype(np.float32), gguf.GGMLQuantizationType[type_name])


def make(fmt: str, k: int, n: int):
    """(quantized weight for the [K, N] kernel, float64 [K, N] it stands for by gguf/reference)."""
    w = RNG.standard_normal((k, n)).astype(np.float32) * 0.1
    if fmt == "int8":
        qw = weight_formats.quantize_int8(w)
        ref = panels.from_panels(qw.q).astype(np.float64) * qw.scale.astype(np.float64)
        return qw, ref
    if fmt == "fp8":
        qw = weight_formats.quantize_fp8(w)
        ref = panels.from_panels(qw.q).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * qw.scale
        return qw, ref
    raw = gguf_bytes(fmt, w.T)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(n, k).T
    qw = weight_formats.quantize(w, fmt.lower())  # the same blocks, through quantize_params' path
    for a, b in zip(qw, weight_formats.from_gguf(raw, fmt)):
        np.testing.assert_array_equal(a, b)
    return qw, ref.astype(np.float64)


def test_int8_round_trip():
    w = RNG.standard_normal((96, 128)).astype(np.float32)
    w[:, 3] = 0  # an all-zero channel keeps a usable scale
    qw = weight_formats.quantize_int8(w)
    assert qw.q.dtype == np.int8 and qw.q.shape == (2, 96, 64) and qw.scale.shape == (128,)
    np.testing.assert_array_equal(np.abs(panels.from_panels(qw.q)).max(axis=0)[[0, 1, 2, 4]], 127)
    deq = np.asarray(weight_formats.dequantize(qw))
    # dequantize is exactly q * scale, and within half a step of the original
    np.testing.assert_array_equal(deq, panels.from_panels(qw.q).astype(np.float32) * qw.scale)
    assert np.all(np.abs(deq - w) <= qw.scale / 2 + 1e-7)
    assert np.all(deq[:, 3] == 0)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_read_as_gguf_dequantizes(fmt):
    """Random bytes (any nibble, any fp16 scale incl. negative and subnormal) read bit for bit."""
    n, k = 128, 96
    bb = weight_formats.GGUF_BLOCK_BYTES[fmt]
    raw = RNG.integers(0, 256, size=(n, k // 32, bb), dtype=np.uint8)
    for off in (0, 2) if fmt == "Q4_1" else (0,):
        scale = (RNG.uniform(-0.05, 0.05, size=(n, k // 32)) * RNG.choice([1, 1e-4], size=(n, k // 32)))
        raw[:, :, off:off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(n, -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(n, k)
    qw = weight_formats.from_gguf(raw, fmt)
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(qw)), ref.T)
    np.testing.assert_array_equal(np.asarray(quant.embed(qw, jnp.arange(n))), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embed_rows(fmt):
    qw, ref = make(fmt, 64, 192)
    ids = jnp.asarray([0, 5, 63, 64, 191, 5], jnp.int32)
    np.testing.assert_allclose(np.asarray(quant.embed(qw, ids)), ref.T[np.asarray(ids)], rtol=1e-6, atol=1e-7)


def test_bytes_per_weight():
    k, n = 256, 512
    float_bytes = k * n * 4
    assert quant_params.weight_bytes(make("int8", k, n)[0]) / float_bytes <= 0.26
    assert quant_params.weight_bytes(make("Q8_0", k, n)[0]) / float_bytes <= 0.27
    for fmt in ("Q4_0", "Q4_1"):
        assert quant_params.weight_bytes(make(fmt, k, n)[0]) / float_bytes <= 0.16


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,rows", [(1, None), (7, None), (16, 13), (64, 64), (100, 53)])
def test_native_matmul_matches_float64(fmt, m, rows):
    check_matches_float64(make(fmt, 160, 192), m, rows)


def check_matches_float64(weight, m: int, rows: int | None) -> None:
    """Native and XLA-fallback products of m rows (`rows` real) against float64 (also used for
    the K-quants); padding rows are zero."""
    qw, ref = weight
    x = RNG.standard_normal((m, ref.shape[0])).astype(np.float32)
    y = np.asarray(jax.jit(quant.linear)(x, qw, None if rows is None else jnp.asarray([rows], jnp.int32)))
    real = m if rows is None else rows
    want = x[:real].astype(np.float64) @ ref
    np.testing.assert_allclose(y[:real], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.all(y[real:] == 0)
    # the XLA fallback (dequantize inside the computation) agrees
    fallback = np.asarray(jax.jit(lambda x, w: quant.linear(x, w, native=False))(x, qw))
    np.testing.assert_allclose(fallback[:real], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_rows_do_not_depend_on_the_batch(fmt):
    check_rows_do_not_depend_on_the_batch(make(fmt, 96, 128)[0], 96)


def check_rows_do_not_depend_on_the_batch(qw, k: int) -> None:
    """Each row's result is the same whatever rows share its call (also used for the K-quants)."""
    x = RNG.standard_normal((50, k)).astype(np.float32)
    f = jax.jit(quant.linear)
    full = np.asarray(f(x, qw))
    for lo, hi in ((0, 1), (3, 10), (17, 50)):
        np.testing.assert_array_equal(np.asarray(f(x[lo:hi], qw)), full[lo:hi])


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_gated(fmt):
    check_gated(make(fmt, 128, 256), make(fmt, 128, 256), 128)


def check_gated(gate, up, k: int) -> None:
    """silu(x @ Wg) * (x @ Wu) of the first 7 of 9 rows, native and XLA, against float64."""
    (wg, g_ref), (wu, u_ref) = gate, up
    x = RNG.standard_normal((9, k)).astype(np.float32)
    y = np.asarray(jax.jit(quant.linear_gated)(x, wg, wu, jnp.asarray([7], jnp.int32)))
    g, u = x[:7].astype(np.float64) @ g_ref, x[:7].astype(np.float64) @ u_ref
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(y[:7], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    fallback = np.asarray(jax.jit(lambda x, a, b: quant.linear_gated(x, a, b, native=False))(x, wg, wu))
    np.testing.assert_allclose(fallback[:7], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.all(y[7:] == 0)


def test_quantize_params_replaces_kernels_and_names_bad_schemes():
    params = {"embed_tokens": {"embedding": RNG.standard_normal((128, 64)).astype(np.float32)},
              "layers_0": {"mlp": {"up_proj": {"kernel": RNG.standard_normal((64, 128)).astype(np.float32)}},
                           "self_attn": {"k_proj": {"kernel": np.ones((64, 32), np.float32)}}},
              "norm": {"weight": np.ones(64, np.float32)}}
    before = quant_params.weight_bytes(params)
    out = quant_params.quantize_params(params, "int8")
    up = out["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(up, weight_formats.Int8Weight) and up.q.shape == (2, 64, 64)
    emb = out["embed_tokens"]["embedding"]  # held as the LM head [H, V]: 2 panels of 64 tokens
    assert isinstance(emb, weight_formats.Int8Weight) and emb.q.shape == (2, 64, 64)
    np.testing.assert_allclose(np.asarray(quant.embed(emb, jnp.arange(128))),
                               params["embed_tokens"]["embedding"], atol=float(emb.scale.max()) / 2 + 1e-6)
    assert out["layers_0"]["self_attn"]["k_proj"]["kernel"].shape == (64, 32)  # N = 32: no panels
    assert quant_params.weight_bytes(out) < before * 0.4
    assert quant_params.quantize_params(out, "int8")["layers_0"]["mlp"]["up_proj"]["kernel"] is up
    q4 = quant_params.quantize_params(params, "q4_1")["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(q4, weight_formats.Q4Weight) and q4.q.shape == (2, 32, 64)
    with pytest.raises(UserError, match="'fp4'.*int8, fp8, q8_0, q4_0, q4_1") as e:
        quant_params.quantize_params(params, "fp4")
    assert e.value.param == "quantization"


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("m", [1, 7, 13])
def test_native_blocks_equal_the_float32_kernel_on_their_values(fmt, m):
    """GGUF blocks decode exactly and are summed in the float32 packed kernel's order: the same bits."""
    qw, _ = make(fmt, 192, 128)
    wp = cpu_kernels.pack_kernel(weight_formats.dequantize(qw))
    x = RNG.standard_normal((m, 192)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear)(x, qw)),
                                  np.asarray(jax.jit(cpu_kernels.cpu_matmul)(x, wp)))
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear_gated)(x, qw, qw)),
                                  np.asarray(jax.jit(cpu_kernels.cpu_matmul_gated)(x, wp, wp)))


@needs_kernel
def test_fp8_decodes_every_value_exactly():
    """All 254 finite float8_e4m3fn bit patterns (subnormals, both zeros, +-448) through the kernel
    (x = I, scale 1) and through dequantize / embed: ml_dtypes' values, bit for bit."""
    bits = np.arange(256, dtype=np.uint8)
    bits[[0x7F, 0xFF]] = 0  # NaN
    q = np.tile(bits, (64, 1))  # [K = 64, N = 256]: column n holds bits[n]
    w = weight_formats.Fp8Weight(panels.to_panels(q), np.ones(256, np.float32))
    want = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear)(np.eye(64, dtype=np.float32), w)), want)
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(w)), want)
    np.testing.assert_array_equal(np.asarray(quant.embed(w, jnp.arange(256))), want.T)
