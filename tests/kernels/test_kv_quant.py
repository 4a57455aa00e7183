"""Quantized KV pages (--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2, pallas_kernels/kv_quant.py):
the round trip's error bounds, every write path against the quantizing scatter, every attention
path against the float oracle on the same (dequantized) pages with NaN-poisoned unused pages,
the memory plan, and the errors a user can get."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxserve.errors import UserError
from jaxserve.model.config import ModelConfig
from jaxserve.runtime import cpu_kernels, memory
from jaxserve.runtime import kv_sizing
from jaxserve.runtime.attention import xla_ragged_paged_attention
from jaxserve.runtime.backend import KernelShape, resolve_backend
from pallas_kernels import gpu, gpu_decode, kv_quant, reference
from pallas_kernels.kv_quant import QuantPages
from tests.kernels.batch import assert_close, make_batch

NAMES = tuple(kv_quant.KV_QUANT_DTYPES)
# Worst relative rounding error of a value in the format's normal range, and its smallest step
# (times the scale: the absolute error floor of tiny values).
REL = {"int8": 0.0, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
STEP = {"int8": 1.0, "fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}
needs_cpu_kernel = pytest.mark.skipif(cpu_kernels.available() is not None, reason="native CPU kernel unavailable")


def quantized(b, name):
    """A batch's float pages quantized (NaN-poisoned blocks get NaN scales)."""
    q, k, v, *md = b.args
    dtype = kv_quant.KV_QUANT_DTYPES[name]
    return (q, QuantPages(*kv_quant.quantize(k, dtype)), QuantPages(*kv_quant.quantize(v, dtype)), *md)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_error_bounds(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4, 64)).astype(np.float32) * np.exp(rng.uniform(-6, 6, (64, 4, 1)))
    x[3, 1] = 0.0  # an all-zero (token, head): scale 0, exact zeros back
    x[5, 2, 7] = 1e-30  # a tiny value next to large ones
    dtype = kv_quant.KV_QUANT_DTYPES[name]
    data, scale = kv_quant.quantize(jnp.asarray(x), dtype)
    assert data.dtype == dtype and scale.dtype == jnp.float32 and scale.shape == (64, 4)
    back = np.asarray(kv_quant.dequantize(QuantPages(data, scale)))
    s = np.asarray(scale)[..., None]
    assert np.isfinite(back).all() and np.all(np.asarray(data.astype(jnp.float32)) ** 2 <= kv_quant.qmax(dtype) ** 2)
    np.testing.assert_allclose(s[..., 0], np.abs(x).max(-1) / kv_quant.qmax(dtype), rtol=1e-6)
    bound = REL[name] * np.abs(x) + 0.5 * STEP[name] * s * (1 + 1e-5)
    assert np.all(np.abs(back - x) <= bound + 1e-30), np.max(np.abs(back - x) - bound)
    assert np.all(back[3, 1] == 0)
    # the row's largest value comes back (almost) exactly: absmax maps onto the format's max
    top = np.abs(x).argmax(-1)[..., None]
    np.testing.assert_allclose(np.take_along_axis(back, top, -1), np.take_along_axis(x, top, -1), rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_writes_quantize_like_the_scatter(name):
    """reference/xla write, the native CPU write and the Pallas TPU write (interpreted) store the
    same bytes and scales; untouched slots keep theirs."""
    rng = np.random.default_rng(1)
    dtype = kv_quant.KV_QUANT_DTYPES[name]
    pages = [QuantPages(*kv_quant.quantize(jnp.asarray(rng.standard_normal((6, 16, 3, 64)), jnp.float32), dtype))
             for _ in range(2)]
    k, v = (jnp.asarray(rng.standard_normal((10, 3, 64)), jnp.float32) for _ in range(2))
    slots = jnp.asarray([17, 18, 19, 40, 41, 0, 0, 47, 33, 34], jnp.int32)
    want = jax.jit(reference.write_kv)(*pages, k, v, slots)
    kq, ks = kv_quant.quantize(k, dtype)
    real = np.asarray([0, 1, 2, 3, 4, 7, 8, 9])
    flat = want[0].data.reshape(-1, 3, 64)[np.asarray(slots)[real]]
    np.testing.assert_array_equal(np.asarray(flat.astype(jnp.float32)), np.asarray(kq[real].astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(want[0].scale.reshape(-1, 3)[np.asarray(slots)[real]]),
                                  np.asarray(ks[real]))
    untouched = np.setdiff1d(np.arange(96), np.asarray(slots))
    np.testing.assert_array_equal(np.asarray(want[1].scale.reshape(-1, 3)[untouched]),
                                  np.asarray(pages[1].scale.reshape(-1, 3)[untouched]))

    def same(got, exp):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(exp)):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))

    if name == "fp8_e4m3":  # the TPU kernel moves bytes: one dtype is enough (interpreting is slow)
        tpu = pallas_kernels.write_kv(*pages, k, v, slots, backend="tpu", interpret=True)
        same([x._replace(data=x.data.reshape(-1, 3, 64)[real_slots(slots)]) for x in tpu],
             [x._replace(data=x.data.reshape(-1, 3, 64)[real_slots(slots)]) for x in want])
    if cpu_kernels.available() is None:
        got = jax.jit(cpu_kernels.cpu_write_kv, donate_argnums=(0, 1))(*cpu_kernels.to_cpu_layout(*pages), k, v, slots)
        same(got, cpu_kernels.to_cpu_layout(*want))


def real_slots(slots):
    """Slots written by real rows (padding rows may land anywhere in the null block)."""
    return np.unique(np.asarray(slots)[np.asarray(slots) >= 16])


CASES = {  # (q_lens, kv_lens)
    "decode": ([1, 1, 1, 1], [1, 9, 16, 17]),
    "mixed": ([1] * 5 + [20, 7], [33, 64, 2, 50, 7, 40, 7]),
}


@pytest.mark.parametrize("name", NAMES)
def test_reference_on_quantized_pages_is_close_to_float(name):
    """The oracle over quantized pages differs from float pages by about the quantization error."""
    b = make_batch(np.random.default_rng(2), *CASES["mixed"], num_q_heads=6, num_kv_heads=2, block_size=16,
                   pad_tokens=3)
    kw = dict(sm_scale=64**-0.5)
    want = reference.ragged_paged_attention(*b.args, **kw)
    got = reference.ragged_paged_attention(*quantized(b, name), **kw)
    tol = {"int8": 0.03, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}[name]
    assert_close(got, want, b.num_real_tokens, rtol=tol, atol=tol)


def float_oracle(b, qargs, **kw):
    """The reference on the dequantized pages, as float32 arrays."""
    q, k, v, *md = qargs
    return reference.ragged_paged_attention(q.astype(jnp.float32), kv_quant.dequantize(k), kv_quant.dequantize(v),
                                            *md, **kw)


# block size 16: the tiled and decode-group paths (the fp8 widening in vector form) for every dtype;
# block size 8: the generic loop (scalar widening).
@pytest.mark.parametrize("name,case,heads,block_size,window,cap", [
    ("int8", "mixed", (9, 3), 16, None, None), ("fp8_e4m3", "mixed", (8, 2), 16, 6, 15.0),
    ("fp8_e5m2", "mixed", (9, 3), 16, None, None), ("int8", "decode", (6, 2), 8, None, None),
    ("fp8_e5m2", "mixed", (6, 2), 8, 6, None)])
def test_xla_and_cpu_paths_match_the_oracle(name, case, heads, block_size, window, cap):
    b = make_batch(np.random.default_rng(3), *CASES[case], num_q_heads=heads[0], num_kv_heads=heads[1],
                   block_size=block_size, pad_tokens=3)
    qargs = quantized(b, name)
    kw = dict(sm_scale=64**-0.5, sliding_window=window, soft_cap=cap)
    want = float_oracle(b, qargs, **kw)
    got = jax.jit(functools.partial(xla_ragged_paged_attention, **kw))(*qargs)
    assert_close(got, want, b.num_real_tokens, rtol=1e-5, atol=1e-5)
    if cpu_kernels.available() is None:
        q, k, v, *md = qargs
        got = jax.jit(functools.partial(cpu_kernels.cpu_ragged_paged_attention, **kw))(
            q, *cpu_kernels.to_cpu_layout(k, v), *md)
        assert_close(got, want, b.num_real_tokens, rtol=2e-5, atol=2e-5)


# block size 8: each page's scale rows padded to 16 in the kernels' scale array
@pytest.mark.parametrize("name,case,heads,window,block_size", [
    ("int8", "mixed", (8, 2), None, 16), ("fp8_e4m3", "decode", (6, 2), 6, 16),
    ("fp8_e5m2", "decode", (9, 3), None, 8)])
def test_gpu_kernels_match_the_oracle_interpreted(name, case, heads, window, block_size):
    """The Mosaic GPU prefill kernel and the split-KV decode kernel (interpreters) over quantized
    pages: bfloat16 q and MMA operands, so bfloat16 tolerances."""
    b = make_batch(np.random.default_rng(4), *CASES[case], num_q_heads=heads[0], num_kv_heads=heads[1],
                   block_size=block_size, pad_tokens=0 if case == "decode" else 3, dtype=jnp.bfloat16)
    qargs = quantized(b, name)
    kw = dict(sm_scale=64**-0.5, sliding_window=window)
    want = float_oracle(b, qargs, **kw)
    got = gpu.ragged_paged_attention(*qargs, **kw, pages_per_chunk=64 // block_size, interpret=True)
    assert_close(got.astype(jnp.float32), want, b.num_real_tokens, rtol=3e-2, atol=3e-2)
    if case == "decode":
        got = gpu_decode.decode_attention(*qargs, **kw, num_splits=2, interpret=True)
        assert_close(got.astype(jnp.float32), want, b.num_real_tokens, rtol=3e-2, atol=3e-2)


def test_memory_plan_counts_data_and_scales():
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=64, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64)
    bf16 = kv_sizing.kv_bytes_per_block(cfg, 16, "bfloat16")
    assert bf16 == 2 * 30 * 3 * 64 * 16 * 2
    for name in NAMES:
        per_block = kv_sizing.kv_bytes_per_block(cfg, 16, name)
        assert per_block == 2 * 30 * 3 * (64 + 4) * 16
        plans = [memory.plan_kv_memory(device_limit=8 << 30, bytes_in_use=1 << 30, activation_bytes=1 << 28,
                                       block_bytes=b, block_size=16, max_model_len=2048) for b in (bf16, per_block)]
        assert 1.85 < plans[1].num_blocks / plans[0].num_blocks < 1.9
        # allocated pages are exactly as large as the plan says
        pages = jax.eval_shape(lambda n=name: kv_quant.empty((7, 16, 3, 64), n))
        assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pages)) * 2 * 30 == 7 * per_block


def test_memory_plan_counts_tpu_fused_scales_as_padded():
    """tpu-fused quantized pages: one array of lane-padded data plus a [2 * Hkv, bs] f32 scale tile
    that HBM pads to (8, 128); the allocation has exactly the plan's logical shapes."""
    from pallas_kernels import tpu

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=64, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64)
    for bs, scale_bytes in ((32, 8 * 128 * 4), (256, 8 * 256 * 4)):
        assert kv_sizing.kv_bytes_per_block(cfg, bs, "int8", 1, "tpu-fused") == 30 * (6 * bs * 128 + scale_bytes)
    assert kv_sizing.kv_bytes_per_block(cfg, 32, "int8", 3, "tpu-fused") == 30 * (2 * 32 * 128 + 8 * 128 * 4)
    shape = (7, *kv_sizing.kv_block_shape("tpu-fused", 32, 3, 64, kv_sizing.kv_storage_dtype("fp8_e5m2")))
    pages = jax.eval_shape(lambda: kv_quant.empty(shape, "fp8_e5m2"))
    assert pages.data.shape == tpu.fused_shape(7, 32, 3, 64, jnp.int8)
    assert pages.scale.shape == tpu.fused_scale_shape(7, 32, 3) and pages.scale.dtype == jnp.float32


def test_tpu_pallas_takes_quantized_kv_at_block_size_32():
    """TPU: the Pallas kernel reads quantized tpu-fused pages at a block size multiple of 32 (the
    sublane packing of 8-bit data); at 16 the default falls back to xla and an explicit pallas is a
    UserError naming the packing; pallas on CPU (the TPU kernel interpreted) follows the same rule."""
    shape16, shape32 = KernelShape(64, 3, 16), KernelShape(64, 3, 32)
    for name in NAMES:
        got = resolve_backend(None, "bfloat16", name, 1, shape32, target="tpu")
        assert (got.attention, got.kv_layout) == ("pallas", "tpu-fused")
    assert resolve_backend(None, "bfloat16", "fp8_e4m3", 1, shape16, target="tpu").attention == "xla"
    with pytest.raises(UserError, match="block size multiple of 32.*float8_e4m3fn.*--attention-backend xla"):
        resolve_backend("pallas", "bfloat16", "fp8_e4m3", 1, shape16, target="tpu")
    assert resolve_backend("pallas", "float32", "int8", 1, shape32).kv_layout == "tpu-fused"
    with pytest.raises(UserError, match="block size multiple of 32"):
        resolve_backend("pallas", "float32", "int8", 1, shape16)


def test_user_errors():
    with pytest.raises(UserError, match=r"'int4'.*int8, fp8_e4m3, fp8_e5m2"):
        resolve_backend(None, "float32", "int4")
    shape = KernelShape(64, 3, 16)
    assert resolve_backend("xla", "bfloat16", "int8", 1, shape, target="tpu").attention == "xla"
    # GPU (sm_90+): the Mosaic GPU kernels read quantized KV (test_lowering lowers them), except at
    # head_dim 80, whose 80-byte rows of 1-byte data fill no SMEM swizzle: xla there
    for name in NAMES:
        assert resolve_backend(None, "bfloat16", name, 1, shape, target="cuda",
                               compute_capability="9.0").attention == "pallas"
    d80 = KernelShape(80, 2, 16)
    assert resolve_backend(None, "bfloat16", "int8", 1, d80, target="cuda", compute_capability="9.0").attention == "xla"
    with pytest.raises(UserError, match="head_dim .* with int8 KV, not 80"):
        resolve_backend("pallas", "bfloat16", "int8", 1, d80, target="cuda", compute_capability="9.0")
    from jaxserve.config import KV_QUANT_DTYPES, EngineConfig

    assert KV_QUANT_DTYPES == NAMES
    with pytest.raises(UserError, match="int4"):
        EngineConfig(model="x", kv_cache_dtype="int4")
