"""On-device sampling for the rows that sample this step, inside the step's executable.

Per-row parameters arrive as arrays in the StepBatch. What costs extra work (random draws,
top-k/top-p/min-p, top-N logprobs) runs under a `lax.cond` on whether any row of this step needs
it, so one executable per bucket serves every mix of requests and a parameter at its neutral value
costs nothing. Penalties and logit bias are sparse per-row entries whose width is part of the
bucket (0 when no row uses them). Each row draws three uniforms (the draw's two levels, a draft's
acceptance) from its own key, fold_in(the seed's 64 bits as a threefry key, output index), so a
seeded request samples the same tokens whatever else is in the batch.

Verification (speculative decoding; `verify_ids` >= 0): drafts are proposed deterministically (an
n-gram lookup, a draft model's argmax), so the proposal puts all its mass q on the draft token d.
Rejection sampling then accepts d with probability p(d) (p: the row's distribution after every
adjustment, temperature and truncation) and otherwise draws from p with d removed, renormalised:
each emitted token is distributed exactly as p. A greedy row accepts d iff d is its argmax.

Sampling is an exact inverse-CDF draw in two levels (a block of 256 tokens by block mass, then a
token inside it), not Gumbel noise over the whole vocabulary: on CPU that noise cost 67 ms per
step at 64 rows. Truncation looks at the top 256 logits of each row first and applies top-k/top-p/
min-p there; only when a row's kept set could reach past them (a flat distribution) does the
batch take the exact full-vocabulary path (a sort, which costs ~0.6 s at 64 rows on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.core.batch import MAX_LOGPROBS
from jaxserve.runtime.bitmask import apply_token_bitmask


class SampleResult(NamedTuple):
    tokens: jax.Array  # i32[S] the row's token: its verify id when accepted, else a draw
    accepted: jax.Array  # bool[S] the row's verify id (>= 0) is accepted
    logprobs: jax.Array  # f32[S] logprob of `tokens` (raw model distribution)
    verify_logprobs: jax.Array  # f32[S] logprob of the verify id (0 where there is none)
    top_ids: jax.Array  # i32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]


def apply_adjustments(logits, b):
    """Penalties and logit bias from the row's sparse entries (adj_ids unique per row, -1 pad):
    repetition on tokens seen in the prompt or output, frequency and presence on output counts,
    then the bias (-inf bans)."""
    s, vocab = logits.shape
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], b.adj_ids.shape)
    ids = jnp.where(b.adj_ids >= 0, b.adj_ids, vocab)  # out of range: dropped by the scatter
    cur = logits.at[rows, ids].get(mode="fill", fill_value=0.0)
    count = b.adj_out_counts
    seen = (count > 0) | (b.adj_in_prompt > 0)
    rep = b.repetition[:, None]
    new = jnp.where(seen, jnp.where(cur > 0, cur / rep, cur * rep), cur)
    new = new - b.frequency[:, None] * count - b.presence[:, None] * (count > 0) + b.adj_bias
    return logits.at[rows, ids].set(new, mode="drop")


def keep_threshold(sorted_desc, probs, t, vocab: int):
    """The smallest logit top-k / top-p / min-p keep, per row [S, 1], from the row's leading
    logits in descending order and their probabilities (over the whole vocabulary). The top
    token is always kept; callers keep every logit >= the threshold (ties included)."""
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(sorted_desc.shape[-1])[None, :]
    k = jnp.where(t.top_k > 0, t.top_k, vocab)[:, None]
    keep = (rank < k) & (cum_before < t.top_p[:, None]) & (probs >= t.min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    return jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)


BLOCK = 256  # tokens per first-level block of the inverse-CDF draw
CANDIDATES = 256  # top logits per row that truncation looks at first


def _first_above(cum, target):
    """Index of the first entry of each row of the non-decreasing `cum` that exceeds `target`."""
    return jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), cum.shape[-1] - 1).astype(jnp.int32)


def draw(weights, u):
    """A token per row with probability weights / sum(weights) (weights >= 0, some > 0), from two
    uniforms u[S, 2]: pick a block of BLOCK tokens by its mass, then a token inside it."""
    s, v = weights.shape
    nb = -(-v // BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, nb * BLOCK - v))).reshape(s, nb, BLOCK)
    cum_blocks = jnp.cumsum(blocks.sum(-1), axis=-1)
    b = _first_above(cum_blocks, u[:, 0] * cum_blocks[:, -1])
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    cum_inner = jnp.cumsum(inner, axis=-1)
    return b * BLOCK + _first_above(cum_inner, u[:, 1] * cum_inner[:, -1])


def _residual_draw(weights, verify, u):
    """(a draw from weights[S, V] without each row's verify token, that token's probability under
    weights). A row without a verify token (-1) reads and drops nothing: it draws from all its
    weights, with probability 0. One draw for every row: no branch per case, which keeps the
    step's compile short (each copy of the draw is ~0.3 s of XLA:CPU compile per bucket)."""
    v = weights.shape[-1]
    col = jnp.where(verify >= 0, verify, v)[:, None]  # out of range: nothing read or dropped
    w_verify = jnp.take_along_axis(weights, col, axis=-1, mode="fill", fill_value=0.0)[:, 0]
    p_verify = w_verify / jnp.sum(weights, axis=-1)
    # All mass on the verify token: it is always accepted; keep the unused draw a valid token.
    drop = (jnp.arange(v)[None, :] == col) & (p_verify < 1.0)[:, None]
    rest = jnp.where(drop, 0.0, weights)  # elementwise: fuses into the draw's first pass
    return draw(rest, u), p_verify


def _truncation_threshold(scaled, t, truncating, keep_topk: bool):
    """Each row's smallest kept logit [S, 1] under top-k/top-p/min-p: from its top CANDIDATES logits
    when that is exact for every truncating row (the kept set ends inside them), else from a sort
    of the whole vocabulary. Rows keep every logit >= it (ties included)."""
    vocab = scaled.shape[-1]
    c = min(CANDIDATES, vocab)
    # The barrier keeps XLA:CPU's TopK (11 ms at 64 rows): without it, next to the fallback's sort,
    # top_k is rewritten into a full sort that runs on every step (0.6-1 s). XLA's SPMD partitioner
    # cannot take a barrier inside a conditional, so a sharded step goes without (keep_topk=False).
    vals, ids = jax.lax.top_k(scaled, c)  # descending
    if keep_topk:
        vals, ids = jax.lax.optimization_barrier((vals, ids))
    probs = jnp.exp(vals - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    threshold = keep_threshold(vals, probs, t, vocab)
    exact = (c == vocab) | jnp.all(~truncating | (threshold[:, 0] > vals[:, -1]))

    def on_vocabulary():
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        return keep_threshold(sorted_desc, jax.nn.softmax(sorted_desc, axis=-1), t, vocab)

    return jax.lax.cond(exact, lambda: threshold, on_vocabulary)


def greedy_argmax(x):
    """Index of each row's largest value (the first among ties): XLA's TopK(1), faster than its
    argmax on CPU. Backends may pass a native one."""
    return jax.lax.top_k(x, 1)[1][:, 0].astype(jnp.int32)


def sample(logits, b, argmax: Callable = greedy_argmax, adjust: bool = False, keep_topk: bool = True) -> SampleResult:
    """logits: f32[S, V] raw model output for the sampling rows; b: the step's batch (StepBatch of
    device arrays). What costs extra work runs only when some row of this step asks for it,
    decided on device (lax.cond), so one executable serves every mix of requests; only the
    adjustment width (`adjust`) is part of the bucket."""
    s, vocab = logits.shape
    raw = logits
    if adjust:  # sparse penalties / bias, then the structured-output mask (when a row has one)
        logits = apply_adjustments(logits, b)
        logits = jax.lax.cond(jnp.any(b.bitmask != -1), lambda: apply_token_bitmask(logits, b.bitmask),
                              lambda: logits)
    greedy_tokens = argmax(logits)
    verify = b.verify_ids

    def random_tokens():
        temp = jnp.where(b.temperature > 0, b.temperature, 1.0)[:, None]
        scaled = logits / temp

        def uniforms(lo, hi, step):  # the seed's 64 bits are the key; one hash per row and step
            key = jax.random.fold_in(jax.random.wrap_key_data(jnp.stack([hi, lo]), impl="threefry2x32"), step)
            return jax.random.uniform(key, (3,), jnp.float32)

        u3 = jax.vmap(uniforms)(b.seed_lo, b.seed_hi, b.steps)
        u, u_accept = u3[:, :2], u3[:, 2]  # the draw's two levels, the draft's acceptance
        truncating = (b.top_k > 0) | (b.top_p < 1) | (b.min_p > 0)
        weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))

        def truncated():
            threshold = _truncation_threshold(scaled, b, truncating, keep_topk)
            return jnp.where(truncating[:, None] & (scaled < threshold), 0.0, weights)

        weights = jax.lax.cond(jnp.any(truncating & (b.temperature > 0)), truncated, lambda: weights)
        sampled, p_verify = _residual_draw(weights, verify, u)
        random = b.temperature > 0
        accepted = jnp.where(random, (verify >= 0) & (u_accept < p_verify), greedy_tokens == verify)
        return jnp.where(random, sampled, greedy_tokens), accepted

    drawn, accepted = jax.lax.cond(jnp.any(b.temperature > 0), random_tokens,
                                   lambda: (greedy_tokens, greedy_tokens == verify))
    accepted = accepted & (verify >= 0)
    tokens = jnp.where(accepted, verify, drawn)
    k = min(MAX_LOGPROBS, vocab)

    def with_logprobs():
        logp = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        verified = jnp.take_along_axis(logp, jnp.maximum(verify, 0)[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, k)
        named = b.logprob_ids[:, :k]  # a row naming its ids lists their logprobs in place of the top-N
        named_lp = jnp.take_along_axis(logp, jnp.maximum(named, 0), axis=-1)
        use = (named[:, :1] >= 0)
        top_ids = jnp.where(use, named, top_ids.astype(jnp.int32))
        top_lp = jnp.where(use, named_lp, top_lp)
        return chosen, jnp.where(verify >= 0, verified, 0.0), top_ids, top_lp

    def without():
        z = jnp.zeros((s,), jnp.float32)
        return z, z, jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32)

    chosen, verified, top_ids, top_lp = jax.lax.cond(jnp.any(b.num_logprobs >= 0), with_logprobs, without)
    return SampleResult(tokens, accepted, chosen, verified, top_ids, top_lp)
