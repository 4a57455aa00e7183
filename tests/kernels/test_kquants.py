"""GGUF Q4_K / Q6_K kept packed (runtime/kquants.py, csrc/quant_matmul.cc formats 4 and 5): blocks
read bit for bit as `gguf.quants.dequantize` reads them, the quantizer writes blocks llama.cpp's
layout decodes close to the input, bytes per weight, and the native kernel (plain and gated)
against float64 and bit for bit against the float32 kernel on the decoded values, rows independent
of the batch, padding rows zero, the embedding gather and the XLA fallback."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_kernels, kquants, quant, quant_params, weight_formats
from tests.kernels.test_quant import check_gated, check_matches_float64, check_rows_do_not_depend_on_the_batch

WHY = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")
RNG = np.random.default_rng(1)
TYPES = ["Q4_K", "Q6_K"]


def random_blocks(type_name: str, n: int, k: int) -> np.ndarray:
    """Random GGUF bytes [N, K / 256 * block bytes]: any quant and scale bits, f16 super-block
    scales of both signs, some subnormal."""
    raw = RNG.integers(0, 256, size=(n, k // 256, kquants.GGUF_BYTES[type_name]), dtype=np.uint8)
    for off in (0, 2) if type_name == "Q4_K" else (208,):
        scale = RNG.uniform(-0.01, 0.01, size=(n, k // 256)) * RNG.choice([1, 1e-3], size=(n, k // 256))
        raw[:, :, off:off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def reference(raw, type_name, n, k) -> np.ndarray:
    """The [K, N] kernel the gguf package reads from `raw`."""
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, k).T


def make(type_name: str, k: int, n: int):
    """(weight from float weights through quantize_params' path, float64 [K, N] it stands for)."""
    w = RNG.standard_normal((k, n)).astype(np.float32) * 0.1
    raw = kquants.quantize_gguf(w.T, type_name)
    qw = weight_formats.quantize(w, type_name.lower())
    for a, b in zip(qw, weight_formats.from_gguf(raw, type_name)):
        np.testing.assert_array_equal(a, b)
    return qw, reference(raw, type_name, n, k).astype(np.float64)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n,k", [(64, 256), (192, 512)])
def test_blocks_read_as_gguf_dequantizes(type_name, n, k):
    raw = random_blocks(type_name, n, k)
    ref = reference(raw, type_name, n, k)
    qw = weight_formats.from_gguf(raw, type_name)
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(qw)), ref)
    np.testing.assert_array_equal(np.asarray(jax.jit(weight_formats.dequantize)(qw)), ref)
    ids = jnp.asarray([0, n - 1, 5, 63, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(quant.embed(qw, ids)), ref.T[np.asarray(ids)])


@pytest.mark.parametrize("type_name,step", [("Q4_K", 1 / 15), ("Q6_K", 1 / 62)])
def test_quantizer_writes_blocks_close_to_the_weights(type_name, step):
    """Within about half a quantization step of each sub-block's range (plus the 6/8-bit rounding
    of the sub-block scales)."""
    w = RNG.standard_normal((512, 128)).astype(np.float32) * 0.1
    raw = kquants.quantize_gguf(w.T, type_name)
    back = reference(raw, type_name, 128, 512)
    span = 2 * np.abs(w).max()
    assert np.abs(back - w).max() <= span * step
    assert np.sqrt(np.mean((back - w) ** 2)) <= span * step / 3


def test_bytes_per_weight():
    k, n = 512, 256
    float_bytes = k * n * 4
    q4k, q6k = make("Q4_K", k, n)[0], make("Q6_K", k, n)[0]
    # 14.5%: the file's 4.5 bits + 6-bit scales in bytes
    assert quant_params.weight_bytes(q4k) / float_bytes == 4.625 / 32
    assert quant_params.weight_bytes(q6k) / float_bytes == 6.5625 / 32  # 20.5%: as in the file
    assert quant_params.weight_bytes(q4k) / float_bytes <= 0.17


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m,rows", [(1, None), (7, None), (16, 13), (64, 64), (100, 53)])
def test_native_matmul_matches_float64(type_name, m, rows):
    check_matches_float64(make(type_name, 512, 192), m, rows)

@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 7, 13])
def test_native_equals_the_float32_kernel_on_its_values(type_name, m):
    """Random blocks decode exactly and are summed in the float32 packed kernel's order."""
    n, k = 128, 512
    qw = weight_formats.from_gguf(random_blocks(type_name, n, k), type_name)
    wp = cpu_kernels.pack_kernel(weight_formats.dequantize(qw))
    x = RNG.standard_normal((m, k)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear)(x, qw)),
                                  np.asarray(jax.jit(cpu_kernels.cpu_matmul)(x, wp)))
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear_gated)(x, qw, qw)),
                                  np.asarray(jax.jit(cpu_kernels.cpu_matmul_gated)(x, wp, wp)))


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
def test_native_rows_do_not_depend_on_the_batch(type_name):
    check_rows_do_not_depend_on_the_batch(make(type_name, 256, 128)[0], 256)


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
def test_native_gated(type_name):
    check_gated(make(type_name, 256, 128), make(type_name, 256, 128), 256)


def test_quantize_params_k_quants_fall_back_where_k_is_not_in_super_blocks():
    params = {"layers_0": {"mlp": {"down_proj": {"kernel": RNG.standard_normal((512, 64)).astype(np.float32)},
                                   "up_proj": {"kernel": RNG.standard_normal((96, 64)).astype(np.float32)}}}}
    for scheme, kind, fallback in (("q4_k", kquants.Q4KWeight, weight_formats.Q4Weight),
                                   ("q6_k", kquants.Q6KWeight, weight_formats.Q8Weight)):
        out = quant_params.quantize_params(params, scheme)["layers_0"]["mlp"]
        assert isinstance(out["down_proj"]["kernel"], kind)
        assert isinstance(out["up_proj"]["kernel"], fallback)  # K = 96: 32-blocks
