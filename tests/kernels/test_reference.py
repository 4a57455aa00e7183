"""The oracle against a per-token numpy loop, and write_kv against explicit slot writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from tests.kernels.batch import assert_close, make_batch


def naive(q, k_pages, v_pages, seq_lens, qsl, tables, num_seqs, *, sm_scale, window, cap):
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    out = np.zeros_like(q)
    hkv = k_pages.shape[2]
    g = q.shape[1] // hkv
    for s in range(int(num_seqs[0])):
        q_len = int(qsl[s + 1] - qsl[s])
        kv_len = int(seq_lens[s])
        blocks = np.asarray(tables[s])
        k = np.concatenate([k_pages[b] for b in blocks])[:kv_len]
        v = np.concatenate([v_pages[b] for b in blocks])[:kv_len]
        for i in range(q_len):
            p = kv_len - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(q.shape[1]):
                sc = k[lo : p + 1, h // g] @ q[int(qsl[s]) + i, h] * sm_scale
                if cap is not None:
                    sc = cap * np.tanh(sc / cap)
                w = np.exp(sc - sc.max())
                out[int(qsl[s]) + i, h] = (w / w.sum()) @ v[lo : p + 1, h // g]
    return out


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 20.0)])
def test_reference_matches_loop(window, cap):
    b = make_batch(np.random.default_rng(0), [1, 9, 4], [1, 17, 8], num_q_heads=8, num_kv_heads=2)
    ref = jax.jit(
        lambda *a: reference.ragged_paged_attention(
            *a, sm_scale=0.125, sliding_window=window, soft_cap=cap
        )
    )(*b.args)
    want = naive(*b.args, sm_scale=0.125, window=window, cap=cap)
    assert_close(ref, want, b.num_real_tokens, rtol=1e-5, atol=1e-5)


def test_write_kv_puts_rows_in_their_slots():
    rng = np.random.default_rng(1)
    k_pages = jnp.zeros((4, 8, 2, 64))
    v_pages = jnp.zeros((4, 8, 2, 64))
    slots = jnp.asarray([9, 10, 31, 0, 1], jnp.int32)  # last two: padding into null block 0
    k = jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.float32)
    kp, vp = jax.jit(reference.write_kv)(k_pages, v_pages, k, -k, slots)
    np.testing.assert_array_equal(kp[1, 1], k[0])
    np.testing.assert_array_equal(kp[1, 2], k[1])
    np.testing.assert_array_equal(kp[3, 7], k[2])
    np.testing.assert_array_equal(vp[3, 7], -k[2])
    assert int(jnp.count_nonzero(kp[2])) == 0
