"""Conservative admission's estimate of how much the running requests will still grow (SGLang's
new_token_ratio; scheduler.py's module docstring says how admission uses it).

The ratio is the share of a request's remaining max_tokens expected to be generated. It starts at
`init_new_token_ratio`, decays each step to a floor (requests often stop before max_tokens), resets
when nothing runs, and after a preemption (SGLang: retraction) is re-estimated from the survivors'
progress, assuming each decodes RETRACT_DECODE_STEPS more tokens.
"""

from __future__ import annotations

from .request import Request

# SGLang's defaults: the floor is init x 0.14, reached after 600 steps; 20 tokens after a retraction
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    def __init__(self, init: float) -> None:
        self.init = init
        self.value = init
        self.floor = init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay = (init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS

    def expected_growth(self, reqs: list[Request], block_size: int, max_len: int, held: int | None = None) -> int:
        """Blocks the requests are expected to need beyond those they hold (or `held`, for one
        being admitted): the rest of the prompt (chunked prefill) and the ratio x the output tokens
        each may still generate. A plain loop without calls: it runs over every running request at
        each step that admits."""
        ratio, total = self.value, 0
        for r in reqs:
            n = len(r.token_ids)
            rest = min(r.max_tokens - (n - len(r.prompt_token_ids)), max_len - n)
            grow = -(-(n + int(ratio * rest)) // block_size) - (len(r.block_ids) if held is None else held)
            if grow > 0:
                total += grow
        return total

    def update(self, preempted: bool, running: list[Request]) -> None:
        """After a step's schedule: re-estimate after a preemption, reset when idle, else decay."""
        if preempted and running:
            decoded = sum(r.num_output_tokens for r in running)
            max_new = sum(r.max_tokens for r in running)
            self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / (max_new + 1))
        elif not running:
            self.value = self.init
        else:
            self.value = max(self.floor, self.value - self.decay)
