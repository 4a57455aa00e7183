"""The on-device sampler draws from the right distribution: empirical frequencies over many seeded
rows match softmax(logits / T) restricted to the top-k / top-p / min-p set, on both the
top-candidates path and the full-vocabulary fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import sampler
from jaxserve.core.batch import BatchBuilder, StepBatch
from jaxserve.core.buckets import BucketKey
from jaxserve.runtime.sampler import sample

ROWS = 4096


def tensors(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> StepBatch:
    """A batch of n sampling rows, each with its own seed."""
    builder = BatchBuilder(max_num_batched_tokens=1, max_num_seqs=n, block_size=16, max_model_len=16, vocab_size=600)
    b = builder.empty(BucketKey(1, n, 0))
    b.temperature[:], b.top_k[:], b.top_p[:], b.min_p[:] = temperature, top_k, top_p, min_p
    b.seed_lo[:] = np.arange(n, dtype=np.uint32)
    return b


def frequencies(logits_row: np.ndarray, t: StepBatch, truncation: bool) -> np.ndarray:
    """Empirical token frequencies over the batch's rows (truncation: the rows ask for it)."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (ROWS, logits_row.size))
    tokens = np.asarray(jax.jit(sample)(logits, t).tokens)
    return np.bincount(tokens, minlength=logits_row.size) / ROWS


def expected(logits_row, temperature, keep) -> np.ndarray:
    p = np.exp((logits_row - logits_row.max()) / temperature) * keep
    return p / p.sum()


# A peaked row over 600 tokens: a few likely tokens and a long flat tail.
PEAKED = np.concatenate([[4.0, 3.5, 3.0, 2.0, 1.0], np.full(595, -3.0)])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_plain_temperature_matches_softmax(temperature):
    got = frequencies(PEAKED, tensors(ROWS, temperature), truncation=False)
    want = expected(PEAKED, temperature, np.ones_like(PEAKED))
    assert np.abs(got - want).max() < 0.03
    assert abs(got[5:].sum() - want[5:].sum()) < 0.03  # the tail is sampled too


@pytest.mark.parametrize(
    "kw,keep",
    [
        (dict(top_k=3), [1, 1, 1, 0, 0]),
        (dict(top_p=0.5), [1, 1, 0, 0, 0]),  # p = .52, .31, .12, ...: mass before 2nd = .52 >= .5
        (dict(min_p=0.2), [1, 1, 1, 0, 0]),  # p >= 0.2 * max
    ],
)
def test_truncation_on_candidates(kw, keep):
    row = PEAKED[:5].copy()
    row = np.concatenate([row, np.full(595, -30.0)])  # the tail holds no mass: candidates are exact
    got = frequencies(row, tensors(ROWS, 1.0, **kw), truncation=True)
    want = expected(row, 1.0, np.concatenate([keep, np.zeros(595)]))
    assert np.abs(got - want).max() < 0.03
    assert got[np.concatenate([keep, np.zeros(595)]) == 0].sum() == 0  # nothing outside the kept set


def test_truncation_falls_back_to_the_whole_vocabulary(monkeypatch):
    """A flat row whose top-p set is larger than the candidates: the exact fallback path."""
    monkeypatch.setattr(sampler, "CANDIDATES", 8)
    row = np.linspace(0.0, 1.0, 64)
    got = frequencies(row, tensors(ROWS, 1.0, top_p=0.9), truncation=True)
    p = expected(row, 1.0, np.ones(64))
    order = np.argsort(-p)
    keep = np.zeros(64)
    keep[order[(np.cumsum(p[order]) - p[order]) < 0.9]] = 1
    assert keep.sum() > 8  # really beyond the candidates
    want = expected(row, 1.0, keep)
    assert np.abs(got - want).max() < 0.03
    assert got[keep == 0].sum() == 0


def test_draw_never_picks_a_zero_weight():
    w = jnp.asarray(np.tile([0.0, 1.0, 0.0, 0.0, 3.0] + [0.0] * 300, (5, 1)), jnp.float32)
    u = jnp.asarray([[0.0, 0.0], [0.999999, 0.999999], [0.5, 0.25], [0.5, 0.26], [0.1, 0.9]], jnp.float32)
    assert set(np.asarray(sampler.draw(w, u)).tolist()) <= {1, 4}


def test_adjustments_match_the_penalty_rules():
    """Repetition on tokens seen in prompt or output, frequency and presence on output counts, then
    the bias; every other logit untouched."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 40)).astype(np.float32) * 3
    builder = BatchBuilder(max_num_batched_tokens=1, max_num_seqs=2, block_size=16, max_model_len=16, vocab_size=40)
    b = builder.empty(BucketKey(1, 2, 8))
    b.repetition[:] = [1.5, 1.0]
    b.frequency[:] = [0.5, 0.0]
    b.presence[:] = [0.25, 0.0]
    b.adj_ids[0, :4] = [3, 7, 9, 12]
    b.adj_out_counts[0, :4] = [2, 0, 1, 0]
    b.adj_in_prompt[0, :4] = [0, 1, 1, 0]
    b.adj_bias[0, :4] = [0, 0, 1.0, -np.inf]
    b.adj_ids[1, :1] = [5]
    b.adj_bias[1, :1] = [10.0]
    got = np.asarray(jax.jit(sampler.apply_adjustments)(jnp.asarray(logits), b))
    want = logits.copy()
    for tok, count, in_prompt, bias in [(3, 2, 0, 0), (7, 0, 1, 0), (9, 1, 1, 1.0), (12, 0, 0, -np.inf)]:
        x = want[0, tok]
        if count or in_prompt:
            x = x / 1.5 if x > 0 else x * 1.5
        want[0, tok] = x - 0.5 * count - 0.25 * (count > 0) + bias
    want[1, 5] += 10.0
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_named_logprob_ids_replace_the_top_n_row_by_row():
    """vLLM's logprob_token_ids: a row naming ids gets those ids' log-softmax values, in its
    order, in place of the top-N; a row naming none keeps the top-N; -1 pads stay unread."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 600)).astype(np.float32)
    b = tensors(3, temperature=0.0)
    b.num_logprobs[:] = [3, 5, 2]
    b.logprob_ids[0, :3] = [599, 0, 17]  # row 1 names none: its top-5
    b.logprob_ids[2, :2] = [5, 5]  # a repeated id is listed twice
    got = jax.jit(sample)(jnp.asarray(logits), b)
    ids, lps = np.asarray(got.top_ids), np.asarray(got.top_logprobs)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    assert ids[0, :3].tolist() == [599, 0, 17]
    np.testing.assert_allclose(lps[0, :3], ref[0, [599, 0, 17]], rtol=1e-6, atol=1e-6)
    assert ids[1, :5].tolist() == np.argsort(-ref[1])[:5].tolist()
    np.testing.assert_allclose(lps[1, :5], np.sort(ref[1])[::-1][:5], rtol=1e-6, atol=1e-6)
    assert ids[2, :2].tolist() == [5, 5] and lps[2, 0] == lps[2, 1] == pytest.approx(ref[2, 5], abs=1e-6)
