"""The on-device sampler draws from the right distribution: empirical frequencies over many seeded
rows match softmax(logits / T) restricted to the top-k / top-p / min-p set, on both the
top-candidates path and the full-vocabulary fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import sampler
from jaxserve.runtime.sampler import SamplingMode, SamplingTensors, sample

ROWS = 4096


def tensors(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingTensors:
    full = lambda v, dt=np.float32: np.full(n, v, dt)  # noqa: E731
    empty = lambda dt=np.int32: np.zeros((n, 0), dt)  # noqa: E731
    return SamplingTensors(full(temperature), full(top_k, np.int32), full(top_p), full(min_p),
                           np.arange(n, dtype=np.uint32), full(0, np.int32), full(0.0), full(0.0), full(1.0),
                           empty(), empty(), empty(), empty(np.float32))


def frequencies(logits_row: np.ndarray, t: SamplingTensors, truncation: bool) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (ROWS, logits_row.size))
    mode = SamplingMode(all_greedy=False, truncation=truncation)
    tokens = np.asarray(jax.jit(sample, static_argnums=2)(logits, t, mode).tokens)
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
