"""The MoE router and grouped matmul (runtime/moe.py) against a per-expert numpy reference: random
routing, ties, every token on one expert, experts with no tokens, one token, padded rows never
routed (NaN there stays there), experts split over devices summing to the whole, and the sigmoid
grouped router (DeepSeek-V3 / GLM-4.5)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import functools

import jax

from jaxserve.runtime.moe import blocked_ragged_dot, grouped_experts, route_sigmoid, route_softmax

H, I, E, K = 16, 8, 8, 2


def silu(x):
    return x / (1 + np.exp(-x))


def reference(x, ids, weights, wg, wu, wd):
    """Token by token, expert by expert, in float64."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            out[t] += weights[t, j] * ((silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e])
    return out


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    return [rng.normal(0, 0.3, s).astype(np.float32) for s in ((E, H, I), (E, H, I), (E, I, H))]


@pytest.fixture(params=["ragged_dot", "blocked"])
def matmul(request):
    """XLA's ragged_dot (GPU, TPU) and the tiled product the CPU backend uses."""
    return jax.lax.ragged_dot if request.param == "ragged_dot" else blocked_ragged_dot


def run(x, ids, w, experts, num_rows=None, matmul=jax.lax.ragged_dot, **kw):
    rows = None if num_rows is None else jnp.asarray([num_rows], jnp.int32)
    return np.asarray(functools.partial(grouped_experts, matmul=matmul)(jnp.asarray(x), jnp.asarray(ids, jnp.int32),
                                                                        jnp.asarray(w, jnp.float32),
                                                                        *map(jnp.asarray, experts), rows, **kw))


@pytest.mark.parametrize("case", ["random", "one_expert", "one_token", "two_experts_idle"])
def test_grouped_matches_reference(experts, case, matmul):
    rng = np.random.default_rng(1)
    t = 1 if case == "one_token" else 13
    x = rng.normal(size=(t, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(t)])
    if case == "one_expert":  # every token's first choice is expert 3, the second expert 5
        ids = np.tile([3, 5], (t, 1))
    if case == "two_experts_idle":
        ids = np.stack([rng.choice([0, 1, 2, 4, 6, 7], K, replace=False) for _ in range(t)])
    w = rng.random((t, K)).astype(np.float32)
    np.testing.assert_allclose(run(x, ids, w, experts, matmul=matmul), reference(x, ids, w, *experts), rtol=1e-5,
                               atol=1e-5)


def test_padded_rows_never_routed(experts, matmul):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, H)).astype(np.float32)
    x[5:] = np.nan  # bucket padding holding garbage
    ids = np.tile([0, 1], (8, 1))
    w = np.full((8, K), 0.5, np.float32)
    got = run(x, ids, w, experts, num_rows=5, matmul=matmul)
    assert np.all(got[5:] == 0)
    np.testing.assert_allclose(got[:5], reference(x[:5], ids[:5], w[:5], *experts), rtol=1e-5, atol=1e-5)


def test_expert_slices_sum_to_the_whole(experts, matmul):
    """Expert parallelism's per-device work: experts [0, 4) and [4, 8) with their offsets."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(9)])
    w = rng.random((9, K)).astype(np.float32)
    halves = [run(x, ids, w, [a[lo:lo + 4] for a in experts], matmul=matmul, expert_offset=lo) for lo in (0, 4)]
    np.testing.assert_allclose(halves[0] + halves[1], run(x, ids, w, experts, matmul=matmul), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,sizes,block", [(7, [0, 3, 0, 4], None), (9, [9, 0, 0, 0], 4), (6, [1, 1, 1, 0], 2),
                                           (5, [0, 0, 0, 0], None), (1, [0, 0, 1, 0], None)])
def test_blocked_ragged_dot_is_ragged_dot(m, sizes, block):
    """Empty groups, one group holding every row, rows past the groups' sum, tiles of 1..4 rows."""
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.normal(size=(m, 6)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(4, 6, 3)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes))
    got = np.asarray(blocked_ragged_dot(lhs, rhs, sizes, block))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[int(sizes.sum()):] == 0)


def test_softmax_router_ties_and_norm():
    logits = jnp.zeros((3, E))  # all tied: the lowest ids win, as lax.top_k orders ties
    w, ids = route_softmax(logits, K, norm_topk_prob=True)
    assert np.asarray(ids).tolist() == [[0, 1]] * 3
    np.testing.assert_allclose(np.asarray(w), 0.5)
    w, _ = route_softmax(logits, K, norm_topk_prob=False)
    np.testing.assert_allclose(np.asarray(w), 1 / E)
    logits = jnp.asarray([[0.0, 2.0, 1.0, 2.0]])  # a tie between 1 and 3 for the top spot
    w, ids = route_softmax(logits, 3, norm_topk_prob=False)
    assert np.asarray(ids).tolist() == [[1, 3, 2]]
    p = np.exp([0.0, 2.0, 1.0, 2.0]) / np.exp([0.0, 2.0, 1.0, 2.0]).sum()
    np.testing.assert_allclose(np.asarray(w)[0], p[[1, 3, 2]], rtol=1e-6)


def test_sigmoid_grouped_router():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, E)).astype(np.float32)
    bias = rng.normal(0, 0.5, E).astype(np.float32)
    w, ids = route_sigmoid(jnp.asarray(logits), jnp.asarray(bias), K, n_group=4, topk_group=2,
                           norm_topk_prob=True, scale=2.5)
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    for t in range(6):
        choice = scores[t] + bias
        groups = choice.reshape(4, 2).sum(-1)  # two experts a group: the top-2 sum is the group's sum
        keep = np.argsort(-groups, kind="stable")[:2]
        allowed = np.concatenate([[2 * g, 2 * g + 1] for g in keep])
        want = allowed[np.argsort(-choice[allowed], kind="stable")[:K]]
        assert sorted(np.asarray(ids)[t].tolist()) == sorted(want.tolist())
        expect = scores[t][np.asarray(ids)[t]]
        np.testing.assert_allclose(np.asarray(w)[t], 2.5 * expect / expect.sum(), rtol=1e-5)
