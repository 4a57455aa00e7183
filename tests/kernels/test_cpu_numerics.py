"""Numerics of the native CPU path that the default settings run (float32 math, bfloat16 KV for a
bfloat16 or GGUF checkpoint): the library leaves the process's floating-point mode alone, the KV
write rounds float32 -> bfloat16 to nearest even on exact ties too, and attention over bfloat16
pages matches the jnp reference at float32 precision on model-like inputs (large scores, long
contexts, decode groups of mixed lengths next to prefill rows)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_kernels
from pallas_kernels import reference
from tests.kernels.batch import assert_close, make_batch

WHY = cpu_kernels.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")


def test_loading_the_library_keeps_denormals():
    """Linking with -ffast-math (GCC < 13) ran crtfastmath's constructor when the library loaded:
    flush-to-zero and denormals-are-zero in the loading thread (Python's, where numpy and XLA's
    inline work run) for the rest of the process, a mode the reference never runs in."""
    assert cpu_kernels.available() is None
    tiny = np.array([1e-39], np.float32)
    assert (tiny * np.float32(3.0))[0] == np.float32(3e-39)


def _tie_values(rng) -> np.ndarray:
    """float32 values exactly halfway between two bfloat16 values (both parities of the kept low
    bit, both signs, tiny to huge), their neighbours one ulp either side, and random ones."""
    hi = rng.integers(0x0080, 0x7F00, 256, dtype=np.uint32)  # normal bfloat16 bit patterns
    hi |= rng.integers(0, 2, 256, dtype=np.uint32) << 15  # sign
    ties = (hi << 16) | 0x8000
    bits = np.concatenate([ties, ties - 1, ties + 1, (hi << 16) | 0x7FFF, (hi << 16) | 0x0001])
    return np.concatenate([bits.view(np.float32), rng.standard_normal(768).astype(np.float32) * 50])


def test_bfloat16_write_rounds_half_to_even_like_xla():
    rng = np.random.default_rng(3)
    vals = _tie_values(rng)
    hkv, d, bs = 2, 64, 16
    t = vals.size // (hkv * d)
    k = vals[: t * hkv * d].reshape(t, hkv, d)
    v = -k[::-1]
    nb = t // bs + 2
    slots = jnp.arange(bs, bs + t, dtype=jnp.int32)
    pages = jnp.zeros((nb, bs, hkv, d), jnp.bfloat16)
    want = cpu_kernels.to_cpu_layout(*jax.jit(reference.write_kv)(pages, pages, k, v, slots))
    got = jax.jit(cpu_kernels.cpu_write_kv)(*cpu_kernels.to_cpu_layout(pages, pages), k, v, slots)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))
    # and XLA's convert is numpy's (ml_dtypes) round-half-even: the reference itself is RNE
    np.testing.assert_array_equal(np.asarray(jnp.asarray(vals).astype(jnp.bfloat16)).view(np.uint16),
                                  vals.astype(jnp.bfloat16).view(np.uint16))


# (q_lens, kv_lens): decode groups of mixed lengths (some past 512 tokens), and prefill rows
# (several 32-row work items) next to them; block_size 16 and head_dim 64/128: the tiled paths.
CASES = {
    "decodes": ([1] * 9, [700, 17, 129, 512, 64, 33, 300, 1, 250]),
    "mixed": ([70, 1, 1, 1, 5], [400, 200, 45, 610, 5]),
}


def _float64_attention(q, k_pages, v_pages, seq_lens, qsl, tables, num_seqs, sm_scale):
    """Ragged paged attention in float64 numpy, row by row: the ground truth both float32
    implementations are measured against."""
    q, kp, vp = (np.asarray(x, np.float64) for x in (q, k_pages.astype(jnp.float32), v_pages.astype(jnp.float32)))
    seq_lens, qsl, tables = np.asarray(seq_lens), np.asarray(qsl), np.asarray(tables)
    _, bs, hkv, _ = kp.shape
    g = q.shape[1] // hkv
    out = np.zeros_like(q)
    for s in range(int(num_seqs[0])):
        n = int(seq_lens[s])
        blocks = tables[s, :-(-n // bs)]
        k, v = kp[blocks].reshape(-1, hkv, q.shape[2])[:n], vp[blocks].reshape(-1, hkv, q.shape[2])[:n]
        for t in range(qsl[s], qsl[s + 1]):
            pos = n - (qsl[s + 1] - t)
            for h in range(q.shape[1]):
                sc = k[: pos + 1, h // g] @ q[t, h] * sm_scale
                w = np.exp(sc - sc.max())
                out[t, h] = w @ v[: pos + 1, h // g] / w.sum()
    return out


@pytest.mark.parametrize("case,heads,head_dim", [("decodes", (9, 3), 64), ("mixed", (9, 3), 64),
                                                 ("mixed", (8, 2), 128)])
def test_bfloat16_pages_as_exact_as_the_reference(case, heads, head_dim):
    """Scores of a trained model's size (q and k scaled so softmax is peaked: logits up to ~40,
    a few outlier channels as in real K) over the same bfloat16 pages: the native kernel's error
    against float64 is float32's, no larger than the jnp reference's (the `xla` path's math). A
    truncated conversion, a bfloat16 product or a coarse exp would be orders of magnitude off."""
    q_lens, kv_lens = CASES[case]
    rng = np.random.default_rng(11)
    b = make_batch(rng, q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                   block_size=16, pad_tokens=3)
    q, k, v, *md = b.args
    chan = np.ones(head_dim, np.float32)
    chan[rng.choice(head_dim, 4, replace=False)] = 12.0
    q, k, v = q * 2.5, (k * 2.5 * chan).astype(jnp.bfloat16), (v * 4.0).astype(jnp.bfloat16)
    kw = dict(sm_scale=head_dim**-0.5)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(q, k, v, *md)
    got = jax.jit(functools.partial(cpu_kernels.cpu_ragged_paged_attention, **kw))(
        q, *cpu_kernels.to_cpu_layout(k, v), *md)
    n = b.num_real_tokens
    exact = _float64_attention(q, k, v, *md, kw["sm_scale"])[:n]
    err_ref = np.abs(np.asarray(ref, np.float64)[:n] - exact).max()
    err_got = np.abs(np.asarray(got, np.float64)[:n] - exact).max()
    assert err_ref < 1e-3  # the comparison means something: float32 math, peaked softmax
    assert err_got <= 2 * err_ref + 1e-6, (err_got, err_ref)
    assert_close(got, ref, n, rtol=1e-3, atol=1e-3)  # finite, zero padding rows
