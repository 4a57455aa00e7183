"""The engine's XLA attention backend against the pure-jnp oracle, on ragged batches with NaN
poisoned unused pages (so any read outside a sequence's own context fails)."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

from jaxserve.runtime.attention import get_backend, xla_ragged_paged_attention
from pallas_kernels import reference
from tests.kernels.batch import assert_close, make_batch

CASES = {
    "decode": ([1, 1, 1, 1], [1, 9, 16, 17]),
    "prefill": ([5, 16, 17], [5, 16, 17]),
    "chunked": ([8, 3, 1, 12], [40, 3, 70, 12]),
    "mixed-long": ([1] * 6 + [20], [33, 64, 65, 2, 100, 7, 20]),
}


@pytest.mark.parametrize(
    "case,heads,window,cap,static",
    [
        ("decode", (4, 4), None, None, True),
        ("decode", (9, 3), 6, None, False),
        ("prefill", (8, 2), None, None, False),
        ("prefill", (4, 4), None, 15.0, True),
        ("chunked", (9, 3), None, None, True),
        ("chunked", (8, 2), 6, None, False),
        ("mixed-long", (8, 2), None, None, False),
        ("mixed-long", (9, 3), 6, 15.0, True),
    ],
)
def test_xla_backend_matches_reference(case, heads, window, cap, static):
    """Both loop-bound modes: static (accelerators) and the batch's extent (XLA:CPU)."""
    q_lens, kv_lens = CASES[case]
    b = make_batch(np.random.default_rng(len(case)), q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                   block_size=8, pad_tokens=5)
    kw = dict(sm_scale=0.125, sliding_window=window, soft_cap=cap)
    sizes = dict(decode_rows=4, decode_blocks_per_chunk=1, prefill_rows=4, blocks_per_chunk=2, static_bounds=static)
    want = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*b.args)
    got = jax.jit(functools.partial(xla_ragged_paged_attention, **sizes, **kw))(*b.args)
    assert_close(got, want, b.num_real_tokens, rtol=2e-5, atol=2e-5)


def test_xla_backend_loops_have_static_trip_counts():
    """Every loop of the compiled xla path has a trip count XLA knows from the shapes (a while
    whose bound is data costs a device->host sync per iteration on GPU)."""
    b = make_batch(np.random.default_rng(0), [1, 1, 5], [9, 17, 20], block_size=8)
    kernel = get_backend("xla", platform="gpu")  # what a GPU without the Pallas kernel runs
    fn = functools.partial(kernel, sm_scale=0.1, decode_rows=2, prefill_rows=4, blocks_per_chunk=2)
    text = jax.jit(fn).lower(*b.args).compile().as_text()
    loops = [line for line in text.splitlines() if re.search(r"= .*\bwhile\(", line)]
    assert len(loops) >= 4  # decode blocks x chunks, (tile, sequence) pairs x chunks
    assert all("known_trip_count" in line for line in loops), [line[:120] for line in loops]


def test_reference_sinks_are_an_extra_softmax_logit():
    """One sequence of 5 tokens, one head: the reference's sink against softmax written out in numpy
    (the sink takes probability mass and adds no value)."""
    b = make_batch(np.random.default_rng(5), [5], [5], num_q_heads=2, num_kv_heads=1, block_size=8)
    sinks = np.asarray([0.7, -1.5], np.float32)
    got = np.asarray(reference.ragged_paged_attention(*b.args, sm_scale=0.3, sinks=sinks))
    q, k_pages, v_pages, _, _, tables, _ = (np.asarray(a) for a in b.args)
    k, v = k_pages[tables[0, 0], :5, 0], v_pages[tables[0, 0], :5, 0]  # [5, D]
    for t in range(5):
        for h in range(2):
            s = np.concatenate([q[t, h] @ k[: t + 1].T * 0.3, [sinks[h]]])
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(got[t, h], p[:-1] @ v[: t + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case,static", [("decode", False), ("chunked", True), ("mixed-long", False)])
def test_xla_backend_sinks_match_reference(case, static):
    q_lens, kv_lens = CASES[case]
    b = make_batch(np.random.default_rng(9), q_lens, kv_lens, num_q_heads=8, num_kv_heads=2, block_size=8,
                   pad_tokens=5)
    sinks = np.random.default_rng(10).normal(0.0, 2.0, 8).astype(np.float32)
    kw = dict(sm_scale=0.125, sliding_window=6 if case == "chunked" else None)
    sizes = dict(decode_rows=4, decode_blocks_per_chunk=1, prefill_rows=4, blocks_per_chunk=2, static_bounds=static)
    want = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*b.args, sinks=sinks)
    got = jax.jit(functools.partial(xla_ragged_paged_attention, **sizes, **kw))(*b.args, sinks=sinks)
    assert_close(got, want, b.num_real_tokens, rtol=2e-5, atol=2e-5)
    plain = jax.jit(functools.partial(xla_ragged_paged_attention, **sizes, **kw))(*b.args)
    assert not np.allclose(np.asarray(plain)[:b.num_real_tokens], np.asarray(got)[:b.num_real_tokens], atol=1e-3)


@pytest.mark.parametrize("static", [True, False])
def test_xla_backend_is_the_same_on_a_narrow_table(static):
    """The context bucket's table (as many columns as the longest context needs) against the same
    table padded to a much wider one, as max_model_len would make it: the same output, bit for bit,
    with the loops bounded by the shapes (accelerators) or by the batch (XLA:CPU)."""
    b = make_batch(np.random.default_rng(4), [1, 1, 1, 6, 1], [9, 30, 2, 40, 17], num_q_heads=8, num_kv_heads=2,
                   block_size=8, pad_tokens=3)
    q, k_pages, v_pages, seq_lens, qsl, tables, num_seqs = b.args
    wide = np.pad(np.asarray(tables), ((0, 0), (0, 64 - tables.shape[1])))
    fn = jax.jit(functools.partial(xla_ragged_paged_attention, sm_scale=0.125, decode_rows=2, decode_blocks_per_chunk=2,
                                   prefill_rows=4, blocks_per_chunk=2, static_bounds=static))
    narrow = np.asarray(fn(*b.args))
    full = np.asarray(fn(q, k_pages, v_pages, seq_lens, qsl, wide, num_seqs))
    assert tables.shape[1] < 16 and wide.shape[1] == 64
    np.testing.assert_array_equal(narrow[:b.num_real_tokens], full[:b.num_real_tokens])
