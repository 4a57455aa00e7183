"""The TPU kernel on its tpu-fused KV layout, in Pallas' TPU interpreter, against the reference.

Pages are built in the engine's [nb, bs, Hkv, D] layout by ``make_batch`` (unreferenced blocks
NaN-poisoned) and fused with ``tpu.fuse_pages``; the kernel is called the way the runner calls it
(``for_step`` with ``v_pages=None``, block sizes from ``tpu.block_sizes``), so the decode and the
prefill/mixed rows of the table both run. 16-bit inputs are compared in float32 on the same
rounded values. Contexts are tiny: interpret mode is slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import kv_quant, reference, tpu
from pallas_kernels.kv_quant import QuantPages
from tests.kernels.batch import MODELS, assert_close, make_batch

KINDS = {  # (q_lens, kv_lens)
    "decode": ([1, 1, 1], [1, 17, 40]),
    "prefill": ([7, 20], [7, 20]),
    "chunked": ([6, 3], [38, 3]),
    "mixed": ([1, 1, 9, 4], [33, 2, 9, 21]),
}


def _run(b, *, decode_only=False, sliding_window=None, soft_cap=None):
    q, k_pages, v_pages, *meta = b.args
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    step = pallas_kernels.for_step(decode_only=decode_only, backend="tpu", interpret=True)
    fused = tpu.fuse_pages(k_pages, v_pages)
    out = jax.jit(functools.partial(step, **kw))(q, fused, None, *meta)
    f32 = [a.astype(jnp.float32) for a in (q, k_pages, v_pages)]
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*f32, *meta)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = 1e-5 if q.dtype == jnp.float32 else 2e-2
    assert_close(out, ref, b.num_real_tokens, rtol=tol, atol=tol)


# A representative sweep of scope 7's families: every GQA ratio class and both head dims.
SHAPES = ["llama3.1-8b/mistral-7b/qwen3-8b", "llama3.2-3b", "qwen2.5-0.5b", "qwen2.5-14b/32b",
          "smollm2-135m", "gqa16"]


@pytest.mark.parametrize("model", SHAPES)
def test_model_shapes_mixed_batch(model):
    hq, hkv, d = MODELS[model]
    b = make_batch(np.random.default_rng(hq * 7 + hkv), *KINDS["mixed"], num_q_heads=hq,
                   num_kv_heads=hkv, head_dim=d, block_size=16, dtype=jnp.bfloat16)
    _run(b)


@pytest.mark.parametrize("kind,dtype", [("decode", jnp.bfloat16), ("prefill", jnp.float16),
                                        ("chunked", jnp.bfloat16), ("mixed", jnp.float16)])
def test_step_kinds(kind, dtype):
    b = make_batch(np.random.default_rng(len(kind)), *KINDS[kind], num_q_heads=9, num_kv_heads=3,
                   head_dim=64, block_size=16, dtype=dtype)
    _run(b, decode_only=kind == "decode")


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_block_sizes_window_and_soft_cap(block_size):
    """Window and cap together; sequences spanning several chunks and a chunk of several pages."""
    b = make_batch(np.random.default_rng(block_size), [1, 5, 1], [150, 70, 3], num_q_heads=8,
                   num_kv_heads=2, head_dim=128, block_size=block_size, dtype=jnp.bfloat16)
    _run(b, sliding_window=37, soft_cap=20.0)


def test_decode_prefetches_across_sequences_and_programs():
    """Decode: one sequence per grid step, each next sequence's first chunk started by the one
    before (in the previous grid step), with sequences of 0 new tokens and padding in between."""
    b = make_batch(np.random.default_rng(3), [1, 1, 0, 1, 1], [300, 1, 5, 16, 130], num_q_heads=4,
                   num_kv_heads=1, head_dim=64, block_size=16, num_pad_seqs=2, pad_tokens=3)
    _run(b, decode_only=True)


def test_fused_layout_pads_lanes_only():
    assert tpu.fused_shape(10, 16, 1, 64, jnp.bfloat16) == (10, 2, 16, 128)
    assert tpu.fused_shape(10, 16, 8, 256, jnp.float32) == (10, 16, 16, 256)
    assert tpu.sublanes(jnp.int8) == 32
    with pytest.raises(ValueError, match="multiple of 16"):
        tpu.fused_shape(10, 8, 2, 128, jnp.bfloat16)


@pytest.mark.parametrize("heads,head_dim,dtype", [(1, 64, jnp.bfloat16), (2, 80, jnp.float16),
                                                  (8, 128, jnp.float32)])
def test_fused_write_matches_reference(heads, head_dim, dtype):
    """write_kv into fused pages (the write kernel, interpreted) equals the scatter into separate
    pages; padding lanes stay zero; 11 tokens over 8-token grid steps (a partial last step)."""
    rng = np.random.default_rng(heads)
    nb, bs, t = 6, 16, 11
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((nb, bs, heads, head_dim)), dtype)
                        for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((t, heads, head_dim)), jnp.float32) for _ in range(2))
    slots = jnp.asarray(rng.permutation(nb * bs)[:t], jnp.int32)
    got, none = pallas_kernels.write_kv(tpu.fuse_pages(k_pages, v_pages), None, k, v, slots,
                                        backend="tpu", interpret=True)
    assert none is None and got.shape == tpu.fused_shape(nb, bs, heads, head_dim, dtype)
    want = reference.write_kv(k_pages, v_pages, k, v, slots)
    for g, w in zip(tpu.unfuse_pages(got, head_dim), want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    np.testing.assert_array_equal(np.asarray(got[..., head_dim:], np.float32), 0.0)


def test_fused_write_pages_held_across_steps():
    """The write reads a page into VMEM once and writes it back when the next token goes
    elsewhere: a 20-token prefill (a page filled over two 8-token grid steps, then the next page),
    a token into a page written before, and padding rows into the null block 0."""
    rng = np.random.default_rng(7)
    nb, bs, heads, d = 6, 16, 2, 64
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((nb, bs, heads, d)), jnp.bfloat16) for _ in range(2))
    # page 3 over steps 0-1, page 1, page 2, page 1 again, then two padding rows into block 0
    slots = [3 * bs + i for i in range(16)] + [bs + i for i in range(4)] + [2 * bs + 7, bs + 4, 0, 0]
    slots = jnp.asarray(slots, jnp.int32)
    k, v = (jnp.asarray(rng.standard_normal((slots.shape[0], heads, d)), jnp.float32) for _ in range(2))
    got, _ = pallas_kernels.write_kv(tpu.fuse_pages(k_pages, v_pages), None, k, v, slots, backend="tpu",
                                     interpret=True)
    want = reference.write_kv(k_pages, v_pages, k, v, slots)
    for g, w in zip(tpu.unfuse_pages(got, d), want):
        np.testing.assert_array_equal(np.asarray(g[1:], np.float32), np.asarray(w[1:], np.float32))


# ---- quantized pages (--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2) ---------------------------
# The kernel widens the int8/fp8 tile (exact) and applies the K scales to the scores and the V
# scales to the probabilities; the oracle is the reference on the dequantized float32 pages.
# Block size 32: the sublane packing of 8-bit data. f32 q: only reassociation separates the two.


def _run_quantized(b, name, *, decode_only=False, **kw):
    q, k_pages, v_pages, *meta = b.args
    dtype = kv_quant.KV_QUANT_DTYPES[name]
    kq, vq = (QuantPages(*kv_quant.quantize(x, dtype)) for x in (k_pages, v_pages))
    kw = dict(sm_scale=0.125, **kw)
    step = pallas_kernels.for_step(decode_only=decode_only, backend="tpu", interpret=True)
    fused = tpu.fuse_pages(kq, vq)
    assert fused.data.dtype == dtype and fused.scale.shape == tpu.fused_scale_shape(*kq.scale.shape)
    out = jax.jit(functools.partial(step, **kw))(q, fused, None, *meta)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(
        q.astype(jnp.float32), kv_quant.dequantize(kq), kv_quant.dequantize(vq), *meta)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = 2e-5 if q.dtype == jnp.float32 else 2e-2
    assert_close(out, ref, b.num_real_tokens, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,kind,heads,window,dtype", [
    ("int8", "mixed", (8, 2, 64), None, jnp.float32),
    ("fp8_e4m3", "decode", (4, 1, 128), 20, jnp.float32),
    ("fp8_e5m2", "chunked", (9, 3, 64), 5, jnp.float32),
    ("int8", "decode", (6, 2, 64), None, jnp.bfloat16),
])
def test_quantized_pages_match_the_oracle(name, kind, heads, window, dtype):
    """GQA 4, 4, 3 and 3 (two of them one kv head), head_dim 64 and 128, decode and mixed/chunked
    prefill, sliding windows; the chunked case caps the scores."""
    hq, hkv, d = heads
    q_lens, kv_lens = {"decode": ([1, 1, 1], [1, 33, 70]), "mixed": ([1, 1, 9, 4], [40, 2, 9, 70]),
                       "chunked": ([6, 3], [70, 3])}[kind]
    b = make_batch(np.random.default_rng(hq + d), q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv,
                   head_dim=d, block_size=32, dtype=dtype, pad_tokens=0 if kind == "decode" else 3)
    # two pages per chunk: sequences span several chunks, and a chunk holds pages not fetched
    extra = {"soft_cap": 20.0} if kind == "chunked" else {}
    _run_quantized(b, name, decode_only=kind == "decode", sliding_window=window, pages_per_chunk=2, **extra)


def test_quantized_layout_and_block_size():
    k, v = (QuantPages(*kv_quant.quantize(jnp.asarray(np.random.default_rng(i).standard_normal((3, 32, 2, 64)),
                                                      jnp.float32), jnp.int8)) for i in range(2))
    fused = tpu.fuse_pages(k, v)
    assert fused.shape == tpu.fused_shape(3, 32, 2, 64, jnp.int8) == (3, 4, 32, 128)
    assert fused.scale.shape == (3, 4, 32)
    np.testing.assert_array_equal(fused.scale[:, 2], k.scale[:, :, 1])  # row 2h: head h's K
    np.testing.assert_array_equal(fused.scale[:, 3], v.scale[:, :, 1])
    for got, want in zip(tpu.unfuse_pages(fused, 64), (k, v)):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert tpu.scale_page_bytes(32, 1) == 8 * 128 * 4 and tpu.scale_page_bytes(256, 8) == 16 * 256 * 4
    with pytest.raises(ValueError, match="multiple of 32"):
        tpu.fused_shape(10, 16, 2, 64, jnp.int8)
    assert "multiple of 32" in pallas_kernels.supported("tpu", dtype=jnp.bfloat16, head_dim=64, group=2,
                                                        block_size=16, kv_dtype=jnp.int8)
    assert pallas_kernels.supported("tpu", dtype=jnp.bfloat16, head_dim=64, group=2, block_size=32,
                                    kv_dtype=jnp.float8_e5m2) is None


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_quantized_fused_write_matches_the_scatter(name):
    """write_kv into quantized fused pages stores the bytes and scales of the quantizing scatter
    into separate pages (the xla path's write); untouched slots keep theirs."""
    rng = np.random.default_rng(5)
    nb, bs, heads, d, t = 4, 32, 2, 64, 11
    dtype = kv_quant.KV_QUANT_DTYPES[name]
    pages = [QuantPages(*kv_quant.quantize(jnp.asarray(rng.standard_normal((nb, bs, heads, d)), jnp.float32), dtype))
             for _ in range(2)]
    k, v = (jnp.asarray(rng.standard_normal((t, heads, d)), jnp.float32) for _ in range(2))
    slots = jnp.asarray(rng.permutation(np.arange(bs, nb * bs))[:t], jnp.int32)  # real blocks only
    got, none = pallas_kernels.write_kv(tpu.fuse_pages(*pages), None, k, v, slots, backend="tpu", interpret=True)
    assert none is None and got.data.dtype == dtype
    want = reference.write_kv(*pages, k, v, slots)
    for g, w in zip(tpu.unfuse_pages(got, d), want):
        np.testing.assert_array_equal(np.asarray(g.data, np.float32), np.asarray(w.data, np.float32))
        np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale))
    np.testing.assert_array_equal(np.asarray(got.data[..., d:], np.float32), 0.0)
