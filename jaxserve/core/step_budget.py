"""An SLO-aware prefill budget per step, from measured step times (no jax).

A step that carries decode rows and a prefill chunk costs about as much as its prefill tokens:
every stream decoding in it waits that long for its next token. vLLM (`--max-num-batched-tokens`)
and SGLang (`--chunked-prefill-size`) bound that with a fixed token count the user must tune per
model and machine; here the engine measures what its steps cost and sizes the chunk for an
inter-token-latency target:

    gap(step) ~= a + c * prefill_tokens      (a: a step of decodes alone; c: seconds per prefill token)

fitted by least squares with exponential forgetting over the steps that had decode rows (`gap` =
time between two steps' results while the engine was busy: the ITL the streams see). The cap is
the prefill tokens that keep a step within the target: (target - a) / c, at least `min_chunk`
(prefills always progress) and at most the step's token budget. The target is `target_s` if given,
else `auto_factor` x a (a mixed step may cost that many decode-only steps), so it follows the
model, the batch and the machine's load. Until the fit has steps with two different prefill sizes
it assumes a = 0 (c = mean gap / mean tokens: a smaller, safe cap once any mixed step was seen).
The scheduler applies the cap only outside a burst of arrivals (from when as many requests wait for
their first token as decode until all that had arrived then have it; scheduler.py): in a burst,
chunking would double TTFT for the ITL it saves, and the burst's prefill goes first instead.
"""

from __future__ import annotations

AUTO_FACTOR = 3.0  # auto target: a mixed step may cost this many decode-only steps
DECAY = 0.97  # weight of the past per observed step (~33-step memory)
MIN_CHUNK = 16  # prefill tokens a step with decodes may always take


class StepBudget:
    def __init__(self, max_tokens: int, target_s: float | None = None, auto_factor: float = AUTO_FACTOR,
                 min_chunk: int = MIN_CHUNK, decay: float = DECAY):
        self.max_tokens = max_tokens
        self.target_s = target_s
        self.auto_factor = auto_factor
        self.min_chunk = min(min_chunk, max_tokens)
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, prefill: int, gap_s: float) -> None:
        """One step that had decode rows: its prefill tokens and its gap (seconds)."""
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + prefill
        self._y = d * self._y + gap_s
        self._xx = d * self._xx + prefill * prefill
        self._xy = d * self._xy + prefill * gap_s

    def fit(self) -> tuple[float, float] | None:
        """(a, c): seconds of a decode-only step and per prefill token; None before any mixed step."""
        w, x, y = self._w, self._x, self._y
        if w <= 0 or x <= 0:
            return None
        mx, my = x / w, y / w
        var = self._xx / w - mx * mx
        if var > (0.05 * mx) ** 2:  # prefill sizes differ enough to separate a from c
            c = (self._xy / w - mx * my) / var
            a = my - c * mx
            if c > 0 and a >= 0:
                return a, c
        return 0.0, my / mx  # all cost put on the tokens: an underestimate of the cap

    def target(self) -> float | None:
        if self.target_s is not None:
            return self.target_s
        f = self.fit()
        return None if f is None or f[0] <= 0 else self.auto_factor * f[0]

    def cap(self) -> int | None:
        """Prefill tokens a step with decode rows may carry (None: no cap yet, or no target)."""
        if self.target_s is not None and self.target_s <= 0:
            return None  # off
        f, target = self.fit(), self.target()
        if f is None or target is None:
            return None
        a, c = f
        n = int((target - a) / c + 1e-6) if c > 0 else self.max_tokens
        return max(self.min_chunk, min(self.max_tokens, n))
