"""One bucket's step as the runner runs it: the bucket's forward executable, then the sampler
executable that every bucket of the same rows (S) and adjustment width (W) shares.

    packed batch (one int32 buffer) --head--> forward[BucketKey](params, kv, head, last_tokens)
                                                  -> (logits f32[S, V], hidden | None), kv
                                    --tail--> sampler[BucketKey(0, S, W)](logits, tail) -> StepResult

Why two executables: the sampler (penalties, bitmask, top-k/top-p/min-p draws, verification,
logprobs) costs more to compile than a small model's forward (XLA:CPU: ~1.4 of a tiny model's
~2.0 s per bucket) and does not depend on the token count T, the attention variant or the context
width. Compiled once per (S, W) instead of once per bucket, a start-up compiles it for a few row
counts instead of every bucket, and identical samplers of other engines come from XLA's
persistent cache. The cost is a second dispatch and a second small host-to-device copy per step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import StepBatch
from jaxserve.runtime import mesh as meshlib


class StepResult(NamedTuple):
    """Per logits row (sampler.SampleResult); tokens padded to s_max for the next step."""

    tokens: jax.Array  # i32[s_max] sampled tokens (rows past S are 0); the next step's last_tokens
    accepted: jax.Array  # bool[S] the row's verify token is accepted
    logprobs: jax.Array  # f32[S]
    verify_logprobs: jax.Array  # f32[S]
    top_ids: jax.Array  # i32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]
    hidden: jax.Array | None = None  # f32[S, H] final-norm hidden state per logits row (pool buckets)


def unpack_batch(flat, specs) -> StepBatch:
    """The inverse of StepBatch.pack() for the fields `specs` names (BatchBuilder.field_specs(key),
    or its forward head / sampler tail: the other fields are None), inside the trace (slices and
    bitcasts: no copies)."""
    fields, off = dict.fromkeys(StepBatch._fields), 0
    for name, shape, dt in specs:
        n = int(np.prod(shape))
        x = flat[off:off + n].reshape(shape)
        fields[name] = x if dt == "int32" else jax.lax.bitcast_convert_type(x, jnp.dtype(dt))
        off += n
    return StepBatch(**fields)


class BucketStep(NamedTuple):
    """A bucket's compiled forward and its (shared) compiled sampler."""

    forward: Any  # (params, kv layers, head, last_tokens) -> ((logits, hidden), kv layers)
    sampler: Any  # (logits, tail) -> StepResult (hidden None)
    split: int  # int32 words of the packed buffer that are the forward's (ModelRunner._forward_size)

    def __call__(self, params, layers, head, tail, last_tokens) -> tuple[StepResult, list]:
        (logits, hidden), layers = self.forward(params, layers, head, last_tokens)
        return self.sampler(logits, tail)._replace(hidden=hidden), layers

    def as_text(self) -> str:
        return self.forward.as_text() + "\n" + self.sampler.as_text()

    def memory_analysis(self) -> list:
        """Both executables' analyses (compat.peak_temp_bytes takes the larger: they run in turn)."""
        return [self.forward.memory_analysis(), self.sampler.memory_analysis()]


def fetch_result(result: StepResult, s: int, logprobs: bool, accepted: bool = False,
                 hidden: bool = False) -> StepResult:
    """A step's tokens on the host (and `accepted` / the logprobs / the hidden rows of a pool
    bucket when asked; None otherwise); blocks until the step ran."""
    want = [True, accepted, logprobs, logprobs, logprobs, logprobs, hidden and result.hidden is not None]
    parts = tuple(x for x, w in zip(result, want) if w)
    if jax.process_count() > 1:  # replicated over processes: read the local copy
        host = iter([meshlib.to_host(x) for x in parts])
    else:
        host = iter([np.asarray(x) for x in jax.device_get(parts)])
    out = StepResult(*(next(host) if w else None for w in want))
    return out._replace(tokens=out.tokens[:s])
