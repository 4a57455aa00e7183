"""The kernels lower for real TPU and CUDA targets from this CPU host (jax.export).

This runs the Pallas -> Mosaic TPU / Mosaic GPU lowering in full; it does not run the device
compilers (Mosaic's layout passes on TPU, ptxas on GPU), which only a device can.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from jaxserve.runtime import compat
from pallas_kernels import ragged_paged_attention
from pallas_kernels.kv_quant import KV_QUANT_DTYPES, QuantPages
from tests.kernels.batch import MODELS


def _shapes(dtype, head_dim, num_q_heads=8, num_kv_heads=2, num_tokens=64, num_seqs=8):
    block_size, num_blocks, max_blocks = 16, 64, 16
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((num_blocks, block_size, num_kv_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((num_blocks, block_size, num_kv_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((num_seqs,), i32),
        jax.ShapeDtypeStruct((num_seqs + 1,), i32),
        jax.ShapeDtypeStruct((num_seqs, max_blocks), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )


def _custom_calls(fn, platform, shapes) -> set[str]:
    text = compat.export(jax.jit(fn), platforms=[platform])(*shapes).mlir_module()
    return set(re.findall(r"custom_call @(\w+)", text)) | set(
        re.findall(r'call_target_name = "(\w+)"', text)
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tpu_lowering(dtype, head_dim):
    fn = functools.partial(
        ragged_paged_attention, sm_scale=0.1, soft_cap=30.0, sliding_window=128, backend="tpu",
        block_q=16, pages_per_chunk=8,
    )
    assert "tpu_custom_call" in _custom_calls(fn, "tpu", _shapes(dtype, head_dim))


@pytest.mark.parametrize("head_dim,heads", [(64, (8, 2)), (128, (32, 8)), (128, (8, 1))])
def test_cuda_lowering(head_dim, heads):
    fn = functools.partial(
        ragged_paged_attention, sm_scale=0.1, soft_cap=30.0, backend="gpu", pages_per_chunk=4
    )
    shapes = _shapes(jnp.bfloat16, head_dim, *heads)
    assert "mosaic_gpu_v2" in _custom_calls(fn, "cuda", shapes)


def _model_shapes(dtype, heads, block_size=16):
    hq, hkv, d = heads
    shapes = list(_shapes(dtype, d, hq, hkv))
    pages = jax.ShapeDtypeStruct((64, block_size, hkv, d), dtype)
    shapes[1] = shapes[2] = pages
    return shapes


MODEL_HEADS = sorted(set(MODELS.values()))


@pytest.mark.parametrize("decode_only", [False, True], ids=["general", "decode"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_sinks_lower(platform, decode_only):
    """gpt-oss's shape (64 q heads, 8 kv heads, head_dim 64) with its 128-token window and the
    sink logits as an argument (as a layer's weights are)."""
    backend, target = {"cuda": ("gpu", "mosaic_gpu_v2"), "tpu": ("tpu", "tpu_custom_call")}[platform]

    def fn(*args):
        *args, sinks = args
        return ragged_paged_attention(*args, sm_scale=0.125, sliding_window=128, sinks=sinks, backend=backend,
                                      decode_only=decode_only)

    shapes = [*_model_shapes(jnp.bfloat16, (64, 8, 64)), jax.ShapeDtypeStruct((64,), jnp.float32)]
    assert target in _custom_calls(fn, platform, shapes)


@pytest.mark.parametrize("heads", MODEL_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_model_shapes_lower(platform, heads):
    backend, target = {"cuda": ("gpu", "mosaic_gpu_v2"), "tpu": ("tpu", "tpu_custom_call")}[platform]
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, backend=backend)
    assert target in _custom_calls(fn, platform, _model_shapes(jnp.bfloat16, heads))


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_head_dims_block_sizes_dtypes_lower(platform, head_dim, dtype, block_size):
    backend, target = {"cuda": ("gpu", "mosaic_gpu_v2"), "tpu": ("tpu", "tpu_custom_call")}[platform]
    fn = functools.partial(
        ragged_paged_attention, sm_scale=0.1, soft_cap=30.0, sliding_window=100, backend=backend
    )
    shapes = _model_shapes(dtype, (9, 3, head_dim), block_size)
    assert target in _custom_calls(fn, platform, shapes)


@pytest.mark.parametrize("heads", MODEL_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
def test_split_kv_decode_lowers_for_cuda(heads):
    step = pallas_kernels.for_step(decode_only=True, backend="gpu")
    fn = functools.partial(step, sm_scale=0.1, soft_cap=30.0, sliding_window=100)
    assert "mosaic_gpu_v2" in _custom_calls(fn, "cuda", _model_shapes(jnp.bfloat16, heads))


@pytest.mark.parametrize("head_dim", [80, 96, 256])
@pytest.mark.parametrize("block_size", [16, 64])
def test_split_kv_decode_head_dims_lower(head_dim, block_size):
    fn = functools.partial(pallas_kernels.for_step(decode_only=True, backend="gpu"), sm_scale=0.1)
    shapes = _model_shapes(jnp.float16, (10, 2, head_dim), block_size)
    assert "mosaic_gpu_v2" in _custom_calls(fn, "cuda", shapes)


def _quant_shapes(name, heads, block_size=16):
    """bfloat16 q, ``name`` (int8 / fp8) pages with their f32 scales [nb, bs, Hkv]."""
    shapes = _model_shapes(jnp.bfloat16, heads, block_size)
    data = jax.ShapeDtypeStruct(shapes[1].shape, KV_QUANT_DTYPES[name])
    shapes[1] = shapes[2] = QuantPages(data, jax.ShapeDtypeStruct(data.shape[:-1], jnp.float32))
    return shapes


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("heads", [(8, 2, 64), (9, 3, 64), (32, 8, 128), (8, 1, 128)],
                         ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_quantized_kv_lowers_for_cuda(name, heads, decode_only):
    """The quantized path of both GPU kernels (widened int8/fp8 tiles, the scales of a page's K and
    V as one TMA copy of 128 bytes at 16-token pages) at the engine's default block size."""
    step = pallas_kernels.for_step(decode_only=decode_only, backend="gpu")
    fn = functools.partial(step, sm_scale=0.1, soft_cap=30.0, sliding_window=100)
    assert "mosaic_gpu_v2" in _custom_calls(fn, "cuda", _quant_shapes(name, heads))


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("name,head_dim,block_size", [("fp8_e5m2", 64, 8), ("int8", 96, 32), ("fp8_e4m3", 256, 64)])
def test_quantized_kv_block_sizes_lower_for_cuda(name, head_dim, block_size, decode_only):
    """Scale rows padded to 16 tokens (8-token pages), and pages whose scales need no padding."""
    fn = functools.partial(pallas_kernels.for_step(decode_only=decode_only, backend="gpu"), sm_scale=0.1)
    shapes = _quant_shapes(name, (10, 2, head_dim), block_size)
    assert "mosaic_gpu_v2" in _custom_calls(fn, "cuda", shapes)


def test_tpu_long_block_tables_split_over_calls():
    """256 sequences x 8192 pages (128k tokens of 16) is 8 MiB of table: SMEM holds 512 KiB of it
    per call, so the sequences split over 16 calls of 16 sequences each."""
    from pallas_kernels import tpu

    assert tpu.table_rows(256, 8192) == 16
    shapes = list(_model_shapes(jnp.bfloat16, (32, 8, 128)))
    shapes[3] = jax.ShapeDtypeStruct((256,), jnp.int32)
    shapes[4] = jax.ShapeDtypeStruct((257,), jnp.int32)
    shapes[5] = jax.ShapeDtypeStruct((256, 8192), jnp.int32)
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, backend="tpu")
    text = compat.export(jax.jit(fn), platforms=["tpu"])(*shapes).mlir_module()
    assert text.count("tpu_custom_call") == 16


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (28, 4, 128)])
def test_tpu_table_block_sizes_lower(heads, decode_only):
    step = pallas_kernels.for_step(decode_only=decode_only, backend="tpu")
    fn = functools.partial(step, sm_scale=0.1, sliding_window=100)
    assert "tpu_custom_call" in _custom_calls(fn, "tpu", _model_shapes(jnp.bfloat16, heads))


@pytest.mark.parametrize("decode_only", [False, True])
def test_backend_ops_pick_the_split_kv_kernel_for_decode_steps(decode_only):
    """What the runner builds per bucket: a GPU backend's attention op (KV write + kernel) for a
    decode-only step calls the split-KV kernel, whose Mosaic GPU call returns (outputs, lse)."""
    from jaxserve.runtime.attention import AttentionMetadata
    from jaxserve.runtime.backend import Backend

    attend = Backend("gpu", "pallas", "paged", False, False, "test").ops(decode_only=decode_only).attention
    q, pages, _, seq_lens, qsl, tables, num_seqs = _model_shapes(jnp.bfloat16, (8, 2, 64))
    new_kv = jax.ShapeDtypeStruct((q.shape[0], 2, 64), jnp.bfloat16)
    md = AttentionMetadata(jax.ShapeDtypeStruct((q.shape[0],), jnp.int32), seq_lens, qsl, tables, num_seqs)

    def step(q, k, v, k_pages, v_pages, md):
        return attend(q, k, v, k_pages, v_pages, md, sm_scale=0.1, sliding_window=None)

    text = compat.export(jax.jit(step), platforms=["cuda"])(q, new_kv, new_kv, pages, pages, md).mlir_module()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1
    assert bool(re.search(r"\) -> \(tensor<", calls[0])) == decode_only


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("decode_only,heads", [(True, (8, 2, 64)), (False, (32, 8, 128)), (False, (9, 3, 64))])
def test_tpu_quantized_pages_lower(name, decode_only, heads):
    """The TPU kernel over quantized tpu-fused pages (int8/fp8 data + f32[nb, 2*Hkv, bs] scales)
    and the quantizing fused write, at the table's block sizes, for a real TPU target."""
    from pallas_kernels import kv_quant, tpu
    from pallas_kernels.kv_quant import QuantPages

    hq, hkv, d = heads
    shapes = list(_model_shapes(jnp.bfloat16, heads, block_size=32))
    nb, bs = 64, 32
    shapes[1] = QuantPages(jax.ShapeDtypeStruct(tpu.fused_shape(nb, bs, hkv, d, jnp.int8),
                                                kv_quant.KV_QUANT_DTYPES[name]),
                           jax.ShapeDtypeStruct(tpu.fused_scale_shape(nb, bs, hkv), jnp.float32))
    shapes[2] = None
    step = pallas_kernels.for_step(decode_only=decode_only, backend="tpu")
    fn = functools.partial(step, sm_scale=0.1, soft_cap=30.0, sliding_window=100)
    assert "tpu_custom_call" in _custom_calls(fn, "tpu", shapes)
    new = jax.ShapeDtypeStruct((shapes[0].shape[0], hkv, d), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((shapes[0].shape[0],), jnp.int32)
    write = functools.partial(pallas_kernels.write_kv, backend="tpu")
    assert "tpu_custom_call" in _custom_calls(write, "tpu", (shapes[1], None, new, new, slots))
