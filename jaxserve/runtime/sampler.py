"""On-device sampling for the rows that sample this step.

Per-row parameters arrive as arrays; what costs extra work (top-k/top-p/min-p, token counts for
penalties, logit bias, top-N logprobs) is switched on by a static `SamplingMode`, so a plain
greedy or plain random batch never pays for it. Each row draws two uniforms from its own key,
fold_in(seed, output index), so a seeded request samples the same tokens whatever else is in the
batch.

Sampling is an exact inverse-CDF draw in two levels (a block of 256 tokens by block mass, then a
token inside it), not Gumbel noise over the whole vocabulary: on CPU that noise cost 67 ms per
step at 64 rows. Truncation looks at the top 256 logits of each row first and applies top-k/top-p/
min-p there; only when a row's kept set could reach past them (a flat distribution) does the
batch take the exact full-vocabulary path (a sort, which costs ~0.6 s at 64 rows on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.cpu_kernels import argmax_rows


class SamplingMode(NamedTuple):
    """Static (compile-time) switches; each distinct value compiles once."""

    all_greedy: bool = True
    truncation: bool = False  # any row uses top-k / top-p / min-p
    penalty_widths: tuple[int, int] = (0, 0)  # padded (output ids, prompt ids) widths; (0, 0) = off
    bias_width: int = 0  # padded logit-bias entries per row (also carries min_tokens EOS bans)
    num_logprobs: int = -1  # -1: none; N >= 0: sampled logprob plus top-N


class SamplingTensors(NamedTuple):
    temperature: np.ndarray  # f32[S] (0 = greedy)
    top_k: np.ndarray  # i32[S] (0 = off)
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    seeds: np.ndarray  # u32[S]
    steps: np.ndarray  # i32[S] output index of the token being sampled
    presence: np.ndarray  # f32[S]
    frequency: np.ndarray  # f32[S]
    repetition: np.ndarray  # f32[S]
    output_ids: np.ndarray  # i32[S, Lo] (-1 pad)
    prompt_ids: np.ndarray  # i32[S, Lp] (-1 pad)
    bias_ids: np.ndarray  # i32[S, A] (-1 pad)
    bias_values: np.ndarray  # f32[S, A]


class SampleResult(NamedTuple):
    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S] logprob of the sampled token (raw model distribution)
    top_ids: jax.Array  # i32[S, N]
    top_logprobs: jax.Array  # f32[S, N]


def _counts(ids, vocab):
    """Per-row token counts from padded id lists: f32[S, V]."""
    s = ids.shape[0]
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], ids.shape)
    return jnp.zeros((s, vocab), jnp.float32).at[rows, jnp.maximum(ids, 0)].add((ids >= 0).astype(jnp.float32))


def apply_penalties(logits, t: SamplingTensors):
    vocab = logits.shape[-1]
    out_counts = _counts(t.output_ids, vocab)
    seen = (out_counts + _counts(t.prompt_ids, vocab)) > 0
    rep = t.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency[:, None] * out_counts
    return logits - t.presence[:, None] * (out_counts > 0)


def apply_bias(logits, t: SamplingTensors):
    s = logits.shape[0]
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], t.bias_ids.shape)
    return logits.at[rows, jnp.maximum(t.bias_ids, 0)].add(jnp.where(t.bias_ids >= 0, t.bias_values, 0.0))


def keep_threshold(sorted_desc, probs, t: SamplingTensors, vocab: int):
    """The smallest logit top-k / top-p / min-p keep, per row [S, 1], from the row's leading
    logits in descending order and their probabilities (over the whole vocabulary). The top
    token is always kept; callers keep every logit >= the threshold (ties included)."""
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(sorted_desc.shape[-1])[None, :]
    k = jnp.where(t.top_k > 0, t.top_k, vocab)[:, None]
    keep = (rank < k) & (cum_before < t.top_p[:, None]) & (probs >= t.min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    return jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)


def truncation_mask(scaled, t: SamplingTensors):
    """Keep-mask for top-k, top-p and min-p over the whole vocabulary (a full sort)."""
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    return scaled >= keep_threshold(sorted_desc, jax.nn.softmax(sorted_desc, axis=-1), t, scaled.shape[-1])


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


def _truncated_draw(scaled, t: SamplingTensors, u):
    """Sample under top-k/top-p/min-p: on each row's top CANDIDATES logits when that is exact for
    every row (the kept set ends inside them), else with truncation_mask over the vocabulary."""
    vocab = scaled.shape[-1]
    c = min(CANDIDATES, vocab)
    # The barrier keeps XLA:CPU's TopK (11 ms at 64 rows): without it, next to the fallback's sort,
    # top_k is rewritten into a full sort that runs on every step (0.6 s).
    vals, ids = jax.lax.optimization_barrier(jax.lax.top_k(scaled, c))  # descending
    probs = jnp.exp(vals - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    threshold = keep_threshold(vals, probs, t, vocab)
    truncating = (t.top_k > 0) | (t.top_p < 1) | (t.min_p > 0)  # other rows draw from everything
    exact = (c == vocab) | jnp.all(~truncating | (threshold[:, 0] > vals[:, -1]))
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))

    def on_candidates():
        w = jnp.where(vals >= threshold, jnp.exp(vals - vals[:, :1]), 0.0)
        kept = jnp.take_along_axis(ids, draw(w, u)[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(truncating, kept, draw(weights, u))

    def on_vocabulary():
        return draw(jnp.where(truncation_mask(scaled, t), weights, 0.0), u)

    return jax.lax.cond(exact, on_candidates, on_vocabulary)


def sample(logits, t: SamplingTensors, mode: SamplingMode) -> SampleResult:
    """logits: f32[S, V] raw model output for the sampling rows."""
    s = logits.shape[0]
    raw = logits
    if mode.penalty_widths != (0, 0):
        logits = apply_penalties(logits, t)
    if mode.bias_width:
        logits = apply_bias(logits, t)
    greedy_tokens = argmax_rows(logits)
    if mode.all_greedy:
        tokens = greedy_tokens
    else:
        temp = jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
        scaled = logits / temp

        def uniforms(seed, step):
            return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step), (2,), jnp.float32)

        u = jax.vmap(uniforms)(t.seeds, t.steps)
        if mode.truncation:
            sampled = _truncated_draw(scaled, t, u)
        else:
            sampled = draw(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), u)
        tokens = jnp.where(t.temperature > 0, sampled, greedy_tokens)
    if mode.num_logprobs < 0:
        zeros = jnp.zeros((s,), jnp.float32)
        return SampleResult(tokens, zeros, jnp.zeros((s, 0), jnp.int32), jnp.zeros((s, 0), jnp.float32))
    logp = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, mode.num_logprobs) if mode.num_logprobs else (
        jnp.zeros((s, 0), jnp.float32), jnp.zeros((s, 0), jnp.int32))
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_lp)
