"""Bucket sizes: which step shapes compile (no jax).

Token rows T come from `token_buckets` (powers of two and their midpoints). Where the attention
backend's work spans the block table it is given (the `xla` path: `Backend.context_buckets`), the
table's width is a bucket dimension too: C block columns, the smallest of `context_widths` that
holds the step's longest context, so a step of short contexts does not pay for `max_model_len`.
"""

from __future__ import annotations

from typing import NamedTuple

# Fewer buckets to compile: a lone sequence gets its own S=1 bucket from this many tokens (a
# prefill chunk), and a step that adjusts logits pads to at least 8 (narrow) or 64 (wide) tokens;
# padding rows cost little (native matmuls and attention skip them; on accelerators they are free).
SINGLE_SEQ_MIN_TOKENS = 16
ADJUST_MIN_TOKENS = (8, 64)
# Context buckets (block-table widths C, in blocks): powers of two from this floor up to max_blocks,
# at most this many (each width multiplies the executables to compile; see context_widths)
CONTEXT_MIN_BLOCKS = 16
MAX_CONTEXT_WIDTHS = 4


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_buckets(max_tokens: int, smallest: int = 1, midpoints: bool = True) -> list[int]:
    """Step sizes that compile: powers of two from `smallest`, plus (`midpoints`) 24, 48, 96, ...
    (padding a step costs at most a third, not half), capped by `max_tokens` (always included)."""
    out, t = [], smallest
    while t < max_tokens:
        out.append(t)
        if midpoints and t >= 16 and t * 3 // 2 < max_tokens:
            out.append(t * 3 // 2)
        t *= 2
    return out + [max(max_tokens, smallest)]


def context_widths(max_blocks: int, smallest: int = CONTEXT_MIN_BLOCKS, most: int = MAX_CONTEXT_WIDTHS) -> list[int]:
    """Block-table widths of the context buckets: powers of two from `smallest`, spaced by the
    least power-of-two factor that keeps them to `most`, then `max_blocks` (always the widest):
    256 blocks -> 16, 64, 256; 512 -> 16, 64, 256, 512; 8192 (128k tokens of 16) -> 16, 128, 1024, 8192."""
    if max_blocks <= smallest or most <= 1:
        return [max_blocks]
    shift = 1
    while True:
        out, c = [], smallest
        while c < max_blocks:
            out.append(c)
            c <<= shift
        if len(out) < most:
            return out + [max_blocks]
        shift += 1


class BucketKey(NamedTuple):
    t: int  # token rows
    s: int  # sequence rows, and logits rows (each at most s)
    w: int  # sparse logit adjustments per row (0: none in this step)
    # every row is one token (token t is sequence t): a decode kernel runs (BatchBuilder's
    # decode_buckets, set where the attention backend has one: pallas on GPU)
    decode: bool = False
    # the executable also returns each logits row's final-norm hidden state (pooling requests);
    # compiled on first use, not by precompile
    pool: bool = False
    # block-table columns per sequence row (0: the full max_blocks): a context bucket, set where
    # the attention backend's work spans the table (BatchBuilder's context_buckets: xla)
    c: int = 0

    def sampler(self) -> BucketKey:
        """The key of the sampler executable this bucket uses: its rows S and adjustment width W
        only (T = 0), so buckets of the same rows share one (worker/runner.py)."""
        return BucketKey(0, self.s, self.w)


def covering_bucket(key: BucketKey, ready, max_blocks: int) -> BucketKey | None:
    """The smallest bucket of `ready` (compiled) that can run a step of bucket `key`: as many or
    more token rows, sequence rows, adjustments and block columns (padding fills the rest), a
    general step for a decode one; None if none can. While buckets compile in the background
    (worker/warm_up.py) steps run on these, so no step waits on a compile."""
    def width(c: int) -> int:
        return c or max_blocks

    fits = [k for k in list(ready) if k.t >= key.t and k.s >= key.s and k.w >= key.w
            and k.pool == key.pool and (not k.decode or key.decode) and width(k.c) >= width(key.c)]
    return min(fits, key=lambda k: (k.t, k.s, k.w, width(k.c), k.decode), default=None)
