"""The split-KV decode kernel (Mosaic GPU interpreter) against the jnp reference: one new token
per sequence, NaN in every page no sequence references, contexts that leave splits empty."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_decode, reference
from tests.kernels.batch import assert_close, interpreted_heads, make_batch

KW = {"sm_scale": 0.125}


def _check(batch, window=None, cap=None, **kernel_kw):
    kw = {**KW, "sliding_window": window, "soft_cap": cap}
    kernel = functools.partial(gpu_decode.decode_attention, interpret=True, **kernel_kw, **kw)
    out = jax.jit(kernel)(*batch.args)
    args = tuple(a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in batch.args)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*args)
    assert out.dtype == batch.args[0].dtype
    assert_close(out, ref, batch.num_real_tokens, rtol=2e-2, atol=2e-2)


def _decode_batch(seed, kv_lens, heads, block_size=16, dtype=jnp.bfloat16, pad=2):
    hq, hkv, d = heads
    return make_batch(np.random.default_rng(seed), [1] * len(kv_lens), kv_lens, num_q_heads=hq,
                      num_kv_heads=hkv, head_dim=d, block_size=block_size, dtype=dtype,
                      num_pad_seqs=pad, pad_tokens=pad)


@pytest.mark.parametrize(
    "model", ["smollm2-135m", "qwen2.5-7b", "llama3.1-70b/qwen2.5-72b/qwen3-32b", "gqa16"]
)
def test_models(model):
    # 300 tokens over 4 splits of 2 chunks of 4 pages; a 1-token context leaves 3 splits empty.
    _check(_decode_batch(1, [400, 1, 47], interpreted_heads(model)), num_splits=4, pages_per_chunk=4)


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_split_counts(splits):
    _check(_decode_batch(2, [130, 17, 64], (12, 2, 128)), num_splits=splits)


@pytest.mark.parametrize("window,cap", [(40, None), (None, 20.0), (100, 30.0)])
def test_window_and_soft_cap(window, cap):
    _check(_decode_batch(3, [250, 33, 90], (9, 3, 64), block_size=32, dtype=jnp.float16),
           window=window, cap=cap, num_splits=3)


@pytest.mark.parametrize("head_dim,block_size", [(80, 16), (96, 64), (256, 32)])
def test_head_dims_and_block_sizes(head_dim, block_size):
    _check(_decode_batch(4, [150, 5], (10, 2, head_dim), block_size=block_size), num_splits=2)


def test_config_fills_the_gpu():
    # batch 1, 8 kv heads, 8k context: 33 splits wanted, capped at 16
    assert gpu_decode.decode_config(128, 4, 16, 1, 8, 512) == (8, 16)
    assert gpu_decode.decode_config(128, 4, 16, 64, 8, 512) == (8, 1)  # 512 CTAs already
    assert gpu_decode.decode_config(128, 4, 16, 8, 8, 512)[1] == 5
    assert gpu_decode.decode_config(128, 4, 16, 1, 8, 8)[1] == 1  # one chunk of context


def test_for_step_picks_the_decode_kernel_only_for_decode_buckets():
    import pallas_kernels

    b = _decode_batch(5, [70, 3], (8, 2, 64))
    decode = pallas_kernels.for_step(decode_only=True, backend="gpu", interpret=True)
    general = pallas_kernels.for_step(decode_only=False, backend="gpu", interpret=True)
    out_d = jax.jit(functools.partial(decode, **KW, num_splits=2))(*b.args)
    out_g = jax.jit(functools.partial(general, **KW))(*b.args)
    assert_close(out_d, out_g, b.num_real_tokens, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="num_splits"):  # the general kernel has no splits
        general(*b.args, **KW, num_splits=2)


def test_one_split_streams_the_whole_ring():
    """A single split over 10 chunks: the ring wraps several times."""
    _check(_decode_batch(6, [640, 200, 1], (8, 2, 64)), num_splits=1, pages_per_chunk=4)


# Every GQA ratio, each with one of the four (head_dim, block_size) pairs in turn: all ratios and all
# pairs are covered in 9 interpret-mode runs instead of 36 (the suite's time budget).
_SHAPES = [(64, 16), (64, 32), (128, 16), (128, 32)]


@pytest.mark.parametrize("group,head_dim,block_size",
                         [(g, *_SHAPES[i % 4]) for i, g in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 16])])
def test_gqa_ratios(group, head_dim, block_size):
    """Every GQA ratio the supported families use, bf16: 133 tokens over two splits of 64-token
    chunks (the 1-token context leaves one split empty), NaN in every page no sequence references."""
    heads = (2 * group, 2, head_dim)
    _check(_decode_batch(7 + group, [133, 1], heads, block_size=block_size, pad=1),
           num_splits=2, pages_per_chunk=64 // block_size)
