"""TPU and GPU kernels in Pallas' interpreters (CPU) against the jnp reference.

TPU: float32 end to end, so float32 tolerance. GPU: WGMMA takes bf16 operands, so the kernel
runs in bf16 and is compared with the reference on the same (bf16-rounded) inputs in float32.
Unreferenced blocks and the null block hold NaN, so reading outside a sequence's context fails;
the interpreters fill freshly allocated buffers (the output too) with NaN, so an unwritten output
row fails the finiteness check.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import gpu, reference, tpu
from tests.kernels.batch import assert_close, make_batch

# (q_lens, kv_lens) with block_size 8: lengths 1, exact block multiples, one past a boundary,
# decode, whole prefill, chunked prefill, and a real sequence with no new tokens.
CASES = {
    "decode": ([1, 1, 1, 1], [1, 8, 9, 24]),
    "prefill": ([8, 9, 1, 16], [8, 9, 1, 16]),
    "chunked": ([5, 1, 3, 0], [21, 17, 3, 9]),
}
HEADS = [(2, 2), (4, 2), (8, 2), (8, 1)]  # GQA ratios 1, 2, 4, 8


def _check(kernel_fn, batch, *, rtol, atol, sliding_window=None, soft_cap=None, to_f32=False):
    kw = {"sm_scale": 0.125, "sliding_window": sliding_window, "soft_cap": soft_cap}
    out = jax.jit(functools.partial(kernel_fn, **kw))(*batch.args)
    ref_args = batch.args
    if to_f32:
        ref_args = tuple(a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in ref_args)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*ref_args)
    assert out.dtype == batch.args[0].dtype
    assert_close(out, ref, batch.num_real_tokens, rtol=rtol, atol=atol)


tpu_kernel = functools.partial(
    tpu.ragged_paged_attention, block_q=4, pages_per_chunk=2, interpret=True
)
gpu_kernel = functools.partial(gpu.ragged_paged_attention, pages_per_chunk=8, interpret=True)


@pytest.mark.parametrize("case", CASES)
def test_tpu_cases(case):
    b = make_batch(np.random.default_rng(list(CASES).index(case)), *CASES[case])
    _check(tpu_kernel, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tpu_gqa_head_dim(heads, head_dim):
    b = make_batch(
        np.random.default_rng(head_dim + heads[0] * 10 + heads[1]),
        *CASES["chunked"],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
    )
    _check(tpu_kernel, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,cap", [(4, None), (None, 5.0), (9, 30.0)])
def test_tpu_window_and_soft_cap(window, cap):
    b = make_batch(np.random.default_rng(7), [1, 12, 2], [30, 12, 17])
    _check(tpu_kernel, b, rtol=1e-5, atol=1e-5, sliding_window=window, soft_cap=cap)


def test_tpu_bfloat16():
    # 16 tokens per page: the TPU's sublane packing of a 16-bit dtype (tpu.fused_shape).
    b = make_batch(np.random.default_rng(8), *CASES["chunked"], dtype=jnp.bfloat16, block_size=16)
    _check(tpu_kernel, b, rtol=2e-2, atol=2e-2, to_f32=True)


def test_tpu_all_padding_batch():
    b = make_batch(np.random.default_rng(9), [], [], num_pad_seqs=3, pad_tokens=5)
    out = tpu_kernel(*b.args, sm_scale=0.1)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("case", CASES)
def test_gpu_cases(case):
    rng = np.random.default_rng(100 + list(CASES).index(case))
    b = make_batch(rng, *CASES[case], dtype=jnp.bfloat16)
    _check(gpu_kernel, b, rtol=2e-2, atol=2e-2, to_f32=True)


@pytest.mark.parametrize(
    "heads,head_dim,window,cap",
    [((2, 2), 128, None, None), ((8, 2), 64, 6, None), ((8, 1), 128, None, 20.0)],
    ids=["gqa1-d128", "gqa4-window", "gqa8-d128-cap"],
)
def test_gpu_variants(heads, head_dim, window, cap):
    b = make_batch(
        np.random.default_rng(11),
        [1, 12, 2],
        [30, 12, 17],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=jnp.bfloat16,
    )
    _check(
        gpu_kernel, b, rtol=2e-2, atol=2e-2, to_f32=True, sliding_window=window, soft_cap=cap
    )


def test_gpu_rejects_float32():
    b = make_batch(np.random.default_rng(12), [1], [1])
    with pytest.raises(ValueError, match="bfloat16"):
        gpu_kernel(*b.args, sm_scale=0.1)


# Odd GQA ratios (tiles padded to 64 rows on GPU, to the sublane multiple on TPU), every block
# size, float16, window and soft cap together; a context long enough for several chunks.
SHAPES = [
    # (Hq, Hkv, D, block_size, dtype, window, cap)
    (9, 3, 64, 16, jnp.bfloat16, None, None),
    (10, 2, 80, 16, jnp.float16, 24, None),
    (12, 2, 96, 32, jnp.bfloat16, None, 30.0),
    (14, 2, 128, 64, jnp.float16, 40, 20.0),
    (16, 1, 256, 32, jnp.bfloat16, None, None),
    (8, 4, 256, 16, jnp.bfloat16, 20, None),  # Gemma 3 4B/12B's local layers (a small window)
]
SHAPE_IDS = [f"g{s[0] // s[1]}-d{s[2]}-bs{s[3]}-{jnp.dtype(s[4]).name}" for s in SHAPES]


def _shape_batch(seed, hq, hkv, d, bs, dtype):
    rng = np.random.default_rng(seed)
    return make_batch(rng, [1, 9, 1, 3], [200, 9, 70, 33], num_q_heads=hq, num_kv_heads=hkv,
                      head_dim=d, block_size=bs, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_gpu_shapes(shape):
    hq, hkv, d, bs, dtype, window, cap = shape
    b = _shape_batch(20 + d, hq, hkv, d, bs, dtype)
    kernel = functools.partial(gpu.ragged_paged_attention, interpret=True)  # table's chunk
    _check(kernel, b, rtol=2e-2, atol=2e-2, to_f32=True, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_tpu_shapes(shape):
    hq, hkv, d, bs, dtype, window, cap = shape
    b = _shape_batch(40 + d, hq, hkv, d, bs, dtype)
    _check(tpu_kernel, b, rtol=2e-2, atol=2e-2, to_f32=True, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("case", ["chunked", "decode"])
def test_tpu_block_tables_split_over_calls(case):
    """Tables over the SMEM budget split the sequences over several kernel calls (forced here with
    a budget of one sequence's row), the outputs summed; no table ever leaves SMEM."""
    b = make_batch(np.random.default_rng(30), *CASES[case], num_q_heads=6, num_kv_heads=2)
    tables = jnp.pad(b.args[5], ((0, 0), (0, 128 - b.args[5].shape[1])))  # one 512-B SMEM row each
    b = dataclasses.replace(b, args=(*b.args[:5], tables, b.args[6]))
    assert tpu.table_rows(tables.shape[0], 128, 512) == 1 < tables.shape[0]
    kernel = functools.partial(tpu_kernel, table_smem_bytes=512)
    _check(kernel, b, rtol=1e-5, atol=1e-5, sliding_window=7)


def test_gpu_ring_deeper_than_a_sequence():
    """More chunks than ring slots (64-token chunks, 4 slots at head_dim 64), and sequences with
    1, 3 and 10 chunks in one tile, so the ring restarts mid-way through its slots."""
    assert gpu.num_stages(64, 64, jnp.bfloat16) == 4
    b = make_batch(np.random.default_rng(31), [1, 2, 1], [600, 170, 1], num_q_heads=6,
                   num_kv_heads=2, dtype=jnp.bfloat16)
    _check(gpu_kernel, b, rtol=2e-2, atol=2e-2, to_f32=True, sliding_window=500)


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "general"])
def test_tpu_block_size_table(decode_only):
    """The table's block sizes (one sequence per program for decode, ~128-row tiles otherwise)
    on a decode batch with an odd GQA ratio; the general row also on a mixed batch."""
    step = pallas_kernels.for_step(decode_only=decode_only, backend="tpu", interpret=True)
    b = make_batch(np.random.default_rng(32), [1, 1, 1], [300, 1, 77], num_q_heads=10,
                   num_kv_heads=2, block_size=16)
    _check(step, b, rtol=1e-5, atol=1e-5)
    if not decode_only:
        b = make_batch(np.random.default_rng(33), [1, 30, 2], [300, 30, 77], num_q_heads=10,
                       num_kv_heads=2, block_size=16)
        _check(step, b, rtol=1e-5, atol=1e-5, soft_cap=25.0)
