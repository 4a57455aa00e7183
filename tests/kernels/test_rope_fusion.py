"""RoPE inside the native KV write and attention (runtime/rope_fusion.py, csrc/rope.h): given a
layer's tables, the calls rotate k as they store it and q as they load it, and the result is the
XLA path's (q and k rotated by `apply_rope`, then the same calls) bit for bit, on every page type,
both kernel paths (tiled and generic), decode groups and prefill items, and partial rotary. Also
the calls' checks of the tables, and a whole layer's attention on the native and xla backends."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.layers import rope_tables
from jaxserve.runtime import cpu_kernels
from jaxserve.runtime.attention import AttentionMetadata, layer_attention
from jaxserve.runtime.rope_fusion import Rope, apply_rope
from pallas_kernels.kv_quant import QuantPages, quantize
from tests.kernels.batch import make_batch

WHY = cpu_kernels.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")

# (q_lens, kv_lens): decode groups, prefill items of several 32-row blocks, a chunk beside decodes
CASES = {"decode": ([1] * 9, [1, 9, 16, 17, 30, 2, 64, 5, 40]),
         "prefill": ([70, 16, 45], [70, 16, 45]),
         "mixed": ([1] * 5 + [40, 12], [33, 64, 2, 100, 7, 90, 12])}


def tables(rng, t: int, rot: int, theta: float = 10000.0) -> Rope:
    positions = jnp.asarray(rng.integers(0, 4096, t), jnp.int32)  # any position per row
    inv_freq = 1.0 / (theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    return Rope(*rope_tables(positions, jnp.asarray(inv_freq, jnp.float32)))


def attention(q, k_pages, v_pages, md, rope=None, **kw):
    return jax.jit(functools.partial(cpu_kernels.cpu_ragged_paged_attention, **kw))(q, k_pages, v_pages, *md,
                                                                                    rope=rope)


@pytest.mark.parametrize("case,head_dim,block_size,rot,pages", [
    ("decode", 64, 16, 64, "float32"),  # SmolLM2's shape: decode groups
    ("prefill", 64, 16, 64, "bfloat16"),  # prefill items, on the default bfloat16 pages
    ("mixed", 128, 16, 128, "float32"),
    ("mixed", 64, 16, 32, "bfloat16"),  # partial rotary: the last 32 dims pass through
    ("mixed", 40, 8, 40, "float32"),  # the generic path
    ("prefill", 64, 16, 64, "int8"),  # quantized pages: q's rotation is the same
])
def test_attention_rotates_q_as_the_xla_path_does(case, head_dim, block_size, rot, pages):
    rng = np.random.default_rng(head_dim + rot)
    q_lens, kv_lens = CASES[case]
    b = make_batch(rng, q_lens, kv_lens, num_q_heads=9, num_kv_heads=3, head_dim=head_dim, block_size=block_size,
                   pad_tokens=5)
    q, k, v, *md = b.args
    if pages == "int8":
        (kq, ks), (vq, vs) = quantize(k, "int8"), quantize(v, "int8")
        kp, vp = cpu_kernels.to_cpu_layout(QuantPages(kq, ks), QuantPages(vq, vs))
    else:
        kp, vp = cpu_kernels.to_cpu_layout(k.astype(pages), v.astype(pages))
    rope = tables(rng, q.shape[0], rot)
    kw = dict(sm_scale=head_dim**-0.5)
    want = attention(jax.jit(apply_rope)(q, rope.cos, rope.sin), kp, vp, md, **kw)
    got = attention(q, kp, vp, md, rope, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the tables matter: without them the output differs
    assert not np.array_equal(np.asarray(attention(q, kp, vp, md, **kw)), np.asarray(want))


@pytest.mark.parametrize("pages,head_dim,rot", [("float32", 64, 64), ("bfloat16", 64, 64), ("bfloat16", 64, 32),
                                                ("float32", 40, 40), ("int8", 64, 64), ("fp8_e4m3", 128, 128)])
def test_kv_write_rotates_k_as_the_xla_path_does(pages, head_dim, rot):
    rng = np.random.default_rng(head_dim)
    t, bs, hkv = 40, 16, 3
    k = jnp.asarray(rng.standard_normal((t, hkv, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, hkv, head_dim)), jnp.float32)
    # consecutive runs crossing blocks, a scattered token, padding rows on the null slot 0
    slots = jnp.asarray(list(range(20, 52)) + [70, 71, 3] + [0] * 5, jnp.int32)
    rope = tables(rng, t, rot)
    if pages in ("int8", "fp8_e4m3"):
        nb = 8
        data = jnp.zeros((nb, bs, hkv, head_dim), jnp.int8 if pages == "int8" else jnp.float8_e4m3fn)
        scale = jnp.zeros((nb, bs, hkv), jnp.float32)
        kp, vp = QuantPages(data, scale), QuantPages(data, scale)
    else:
        kp = vp = jnp.zeros((8, bs, hkv, head_dim), pages)
    write = jax.jit(cpu_kernels.cpu_write_kv)
    want = write(kp, vp, jax.jit(apply_rope)(k, rope.cos, rope.sin), v, slots)
    got = write(kp, vp, k, v, slots, rope)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def test_the_calls_name_tables_of_the_wrong_shape():
    rng = np.random.default_rng(0)
    b = make_batch(rng, [5, 3], [5, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    q, k, v, *md = b.args
    kp, vp = cpu_kernels.to_cpu_layout(k, v)
    for bad in (tables(rng, q.shape[0] - 1, 64), tables(rng, q.shape[0], 128)):  # rows; wider than head_dim
        with pytest.raises(Exception, match=r"paged attention: the RoPE tables must be f32\[T, R\]"):
            attention(q, kp, vp, md, bad, sm_scale=0.125)
        with pytest.raises(Exception, match=r"kv write: the RoPE tables must be f32\[T, R\]"):
            jax.block_until_ready(cpu_kernels.cpu_write_kv(kp, vp, q[:, :2], q[:, :2], jnp.zeros(q.shape[0], jnp.int32),
                                                           bad))


@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
def test_a_layer_attends_alike_on_the_native_and_xla_backends(kv):
    """layer_attention with `rope`: the native calls rotate inside, the xla backend as ops first."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, [1, 1, 30, 7], [9, 40, 30, 20], num_q_heads=9, num_kv_heads=3, head_dim=64,
                   block_size=16, pad_tokens=2)
    q, k_pages, v_pages, seq_lens, qsl, tables_, num_seqs = b.args
    t = q.shape[0]
    k_new = jnp.asarray(rng.standard_normal((t, 3, 64)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((t, 3, 64)), jnp.float32)
    # the new tokens' slots: each sequence's last q_len positions, padding on the null slot
    slots = np.zeros(t, np.int32)
    bt, sl, starts = np.asarray(tables_), np.asarray(seq_lens), np.asarray(qsl)
    for s in range(int(num_seqs[0])):
        for i, tok in enumerate(range(starts[s], starts[s + 1])):
            pos = sl[s] - (starts[s + 1] - starts[s]) + i
            slots[tok] = bt[s, pos // 16] * 16 + pos % 16
    md = AttentionMetadata(jnp.asarray(slots), seq_lens, qsl, tables_, num_seqs)
    rope = tables(rng, t, 64)
    outs = {}
    for name in ("cpu", "xla"):
        kp, vp = k_pages.astype(kv), v_pages.astype(kv)
        if name == "cpu":
            kp, vp = cpu_kernels.to_cpu_layout(kp, vp)
        attend = jax.jit(functools.partial(layer_attention(name), sm_scale=0.125))
        outs[name] = np.asarray(attend(q, k_new, v_new, kp, vp, md, rope=rope)[0])
    real = int(qsl[num_seqs[0]])
    np.testing.assert_allclose(outs["cpu"][:real], outs["xla"][:real], rtol=2e-5, atol=2e-5)
