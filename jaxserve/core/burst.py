"""A burst of arrivals, as the scheduler treats it (scheduler.py `schedule`).

A burst begins when the requests waiting for their first token (prefilling, or not yet admitted)
are at least as many as those decoding, and some decode; it ends when every request that had
arrived by then has its first token. A prompt arriving next to more decodes starts none.

In a burst the step budget's prefill cap (step_budget.py) is off: each extra chunk would delay all
of the burst's requests by a step, which costs more TTFT than the decodes' ITL gains. And with
`burst_prefill_first` (the default) a step carries prefill chunks alone, and the decodes run once
no chunk is left to schedule: a stream then waits once, for the burst, instead of at each of its
chunk steps (with decodes beside every chunk, P99 inter-token latency is a chunk step), and the
burst ends sooner. Its last step, with room left beside the last chunk, carries no decodes either:
they would add their attention to the step that brings the burst's last first token (~30 ms for 31
decode rows beside a 56-token chunk on SmolLM2-135M), and they cost about that much again as a step
of their own right after. The longest gap a stream sees grows to the burst's length (bench/RESULTS.md,
tails).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from .request import Request


class Burst:
    def __init__(self) -> None:
        self.end: int | None = None  # the burst's requests: arrival order below this

    @property
    def active(self) -> bool:
        return self.end is not None

    def update(self, running: Iterable[Request], waiting: Collection[Request], decodes: int,
               order: dict[str, int], next_order: int) -> None:
        """At the start of a step: `decodes` of the running requests decode; `order` is every
        request's arrival order, `next_order` the next arrival's."""
        prefilling = [r for r in running if len(r.token_ids) - r.num_computed_tokens > 1]
        if self.end is not None and not any(order[r.request_id] < self.end for r in (*prefilling, *waiting)):
            self.end = None
        if self.end is None and decodes and len(prefilling) + len(waiting) >= decodes:
            self.end = next_order
