"""The Mosaic TPU KV-write kernel (Pallas' TPU interpreter, CPU) against ``reference.write_kv``,
its dispatch, and its lowering for a real TPU target from this host (jax.export)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import kv_write, reference

NUM_BLOCKS, BLOCK_SIZE, HKV, HEAD_DIM = 7, 4, 2, 8


def _batch(rng, num_real, num_pad, *, dtype=jnp.float32, kv_dtype=None):
    """Real tokens go to distinct slots outside the null block 0, always including both ends of
    a block (offset 0 and block_size - 1); padding tokens all point into block 0, repeatedly."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, HKV, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    boundary = [BLOCK_SIZE, 2 * BLOCK_SIZE - 1]  # first and last slot of block 1
    rest = rng.permutation(np.arange(2 * BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE))
    real = np.concatenate([boundary, rest])[:num_real]
    pad = np.array([0, 0, 3, 0, 1][:num_pad] + [0] * max(0, num_pad - 5))
    slots = np.concatenate([real, pad]).astype(np.int32)
    order = rng.permutation(num_real)  # real slots in no particular order
    slots[:num_real] = slots[:num_real][order]
    num_tokens = num_real + num_pad
    kv_dtype = kv_dtype or dtype
    k = jnp.asarray(rng.standard_normal((num_tokens, HKV, HEAD_DIM)), kv_dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, HKV, HEAD_DIM)), kv_dtype)
    return (k_pages, v_pages, k, v, jnp.asarray(slots)), slots[:num_real]


def _check(out, ref, before, real_slots):
    flat = NUM_BLOCKS * BLOCK_SIZE
    written_blocks = set((real_slots // BLOCK_SIZE).tolist())
    for o, r, b in zip(out, ref, before):
        assert o.shape == b.shape and o.dtype == b.dtype
        o = np.asarray(o.astype(jnp.float32)).reshape(flat, HKV, HEAD_DIM)
        r = np.asarray(r.astype(jnp.float32)).reshape(flat, HKV, HEAD_DIM)
        b = np.asarray(b.astype(jnp.float32)).reshape(flat, HKV, HEAD_DIM)
        # Every slot outside the null block matches the reference (written or untouched) ...
        np.testing.assert_array_equal(o[BLOCK_SIZE:], r[BLOCK_SIZE:])
        np.testing.assert_array_equal(o[real_slots], r[real_slots])
        # ... and blocks no real token points at are exactly as they were.
        for blk in set(range(1, NUM_BLOCKS)) - written_blocks:
            sl = slice(blk * BLOCK_SIZE, (blk + 1) * BLOCK_SIZE)
            np.testing.assert_array_equal(o[sl], b[sl])


@pytest.mark.parametrize(
    "num_real,num_pad,tokens_per_step",
    [
        (1, 0, 8),  # single decode token, partial step
        (8, 0, 8),  # exactly one step
        (9, 4, 8),  # non-multiple of the step, repeated padding slots in block 0
        (13, 3, 8),  # exactly two steps with padding
        (20, 5, 8),  # most of the cache, non-multiple
        (6, 5, 1),  # one token per step
        (11, 2, 5),  # odd step size
    ],
)
def test_interpret_matches_reference(num_real, num_pad, tokens_per_step):
    rng = np.random.default_rng(num_real * 100 + num_pad * 10 + tokens_per_step)
    args, real_slots = _batch(rng, num_real, num_pad)
    fn = functools.partial(kv_write.write_kv_tpu, tokens_per_step=tokens_per_step, interpret=True)
    out = jax.jit(fn)(*args)
    ref = jax.jit(reference.write_kv)(*args)
    _check(out, ref, args[:2], real_slots)


def test_interpret_casts_to_page_dtype():
    args, real_slots = _batch(np.random.default_rng(7), 10, 2, dtype=jnp.bfloat16,
                              kv_dtype=jnp.float32)
    out = jax.jit(functools.partial(kv_write.write_kv_tpu, interpret=True))(*args)
    ref = jax.jit(reference.write_kv)(*args)
    _check(out, ref, args[:2], real_slots)


def test_dispatch():
    args, real_slots = _batch(np.random.default_rng(11), 12, 3)
    ref = jax.jit(reference.write_kv)(*args)
    # auto on CPU with interpret=True runs the TPU kernel (as ragged_paged_attention does).
    auto = jax.jit(functools.partial(pallas_kernels.write_kv, interpret=True, tokens_per_step=4))
    _check(auto(*args), ref, args[:2], real_slots)
    for backend in ("reference", "gpu", "auto"):  # XLA scatter
        out = jax.jit(functools.partial(pallas_kernels.write_kv, backend=backend))(*args)
        for o, r in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
    with pytest.raises(ValueError, match="unknown attention backend"):
        pallas_kernels.write_kv(*args, backend="cuda")


def _export_text(fn, platform, dtype, num_tokens=37):
    pages = jax.ShapeDtypeStruct((64, 16, 8, 128), dtype)
    rows = jax.ShapeDtypeStruct((num_tokens, 8, 128), dtype)
    slots = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    jitted = jax.jit(fn, donate_argnums=(0, 1))
    return jax.export.export(jitted, platforms=[platform])(pages, pages, rows, rows, slots)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tpu_lowering(dtype):
    fn = functools.partial(pallas_kernels.write_kv, backend="tpu", tokens_per_step=8)
    exported = _export_text(fn, "tpu", dtype)
    text = exported.mlir_module()
    assert "tpu_custom_call" in set(re.findall(r'call_target_name = "(\w+)"', text)) | set(
        re.findall(r"custom_call @(\w+)", text)
    )
    # The pages are aliased through the kernel, so donated pages are updated in place.
    assert "output_operand_aliases" in text
    assert "scatter" not in text


def test_gpu_keeps_xla_scatter():
    fn = functools.partial(pallas_kernels.write_kv, backend="gpu")
    text = _export_text(fn, "cuda", jnp.bfloat16).mlir_module()
    assert "scatter" in text and "tpu_custom_call" not in text
