"""Verification rows of the sampler (speculative decoding): a deterministic draft d is accepted
with probability p(d) and otherwise replaced by a draw from p without d, so emitted tokens are
distributed exactly as without speculation. Checked over 4096 seeded rows with chi-square tests
at significance 0.001 (the seeds are fixed, so each run draws the same tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.core.batch import BatchBuilder
from jaxserve.core.buckets import BucketKey
from jaxserve.runtime.sampler import sample

ROWS = 4096
ALPHA = 1e-3
# A few likely tokens and a long flat tail over 600 tokens.
LOGITS = np.concatenate([[4.0, 3.5, 3.0, 2.0, 1.0], np.full(595, -3.0)]).astype(np.float32)


def batch(n, temperature, top_p=1.0, verify=-1, seed0=0):
    b = BatchBuilder(max_num_batched_tokens=1, max_num_seqs=n, block_size=16, max_model_len=16,
                     vocab_size=LOGITS.size).empty(BucketKey(1, n, 0))
    b.temperature[:], b.top_p[:], b.verify_ids[:] = temperature, top_p, verify
    b.seed_lo[:] = np.arange(seed0, seed0 + n, dtype=np.uint32)
    b.num_logprobs[:] = 0
    return b


def run(b):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (b.temperature.size, LOGITS.size))
    return jax.tree.map(np.asarray, jax.jit(sample)(logits, b))


def bins(tokens):
    """Counts of tokens 0..4 and of the tail (the chi-square needs expected counts >= 5)."""
    c = np.bincount(tokens, minlength=LOGITS.size)
    return np.append(c[:5], c[5:].sum())


def target(temperature, top_p):
    p = np.exp((LOGITS.astype(np.float64) - LOGITS.max()) / temperature)
    p /= p.sum()
    if top_p < 1:  # keep the smallest prefix (descending) whose mass before a token is < top_p
        order = np.argsort(-p)
        keep = np.zeros_like(p, bool)
        keep[order[(np.cumsum(p[order]) - p[order]) < top_p]] = True
        p = np.where(keep, p, 0)
        p /= p.sum()
    return np.append(p[:5], p[5:].sum())


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("draft", [1, 0, 3])
def test_rejection_sampling_keeps_the_target_distribution(top_p, draft):
    spec = run(batch(ROWS, 0.8, top_p, verify=draft))
    plain = run(batch(ROWS, 0.8, top_p, seed0=ROWS))  # no speculation, other seeds
    p = target(0.8, top_p)
    nz = p > 0
    got = bins(spec.tokens)
    assert got[~nz].sum() == 0, "a token outside the kept set was emitted"
    want_counts = p[nz] / p[nz].sum() * got.sum()
    assert stats.chisquare(got[nz], want_counts).pvalue > ALPHA
    table = np.stack([got, bins(plain.tokens)])[:, nz]
    assert stats.chi2_contingency(table).pvalue > ALPHA
    # Acceptance happens at rate p(draft), and an accepted row emits the draft.
    acc = spec.accepted
    assert np.all(spec.tokens[acc] == draft)
    rate = acc.mean()
    want = p[draft] if draft < 5 else 0.0
    assert abs(rate - want) < 4 * np.sqrt(want * (1 - want) / ROWS) + 1e-9
    # The logprob of the verified token is the raw model's, accepted or not.
    logp = jax.nn.log_softmax(jnp.asarray(LOGITS))
    np.testing.assert_allclose(spec.verify_logprobs, float(logp[draft]), rtol=1e-5)


def test_a_truncated_draft_is_never_accepted():
    spec = run(batch(ROWS, 0.8, top_p=0.5, verify=3))  # token 3 is outside the top-p set
    assert not spec.accepted.any()
    assert set(np.unique(spec.tokens)) <= {0, 1}


def test_greedy_verification_accepts_exactly_the_argmax():
    b = batch(4, 0.0)
    b.verify_ids[:] = [0, 1, -1, 599]
    r = run(b)
    assert r.accepted.tolist() == [True, False, False, False]
    assert r.tokens.tolist() == [0, 0, 0, 0]


def test_mixed_rows_sample_independently_of_verification():
    """Rows that verify nothing draw the same tokens whether or not other rows verify."""
    plain = run(batch(64, 0.8))
    b = batch(64, 0.8)
    b.verify_ids[::2] = 2
    mixed = run(b)
    np.testing.assert_array_equal(mixed.tokens[1::2], plain.tokens[1::2])
    assert not mixed.accepted[1::2].any()
