"""A request's host-side state: its tokens, how many of them have KV in the cache, its blocks.

Jax-free on purpose: the scheduler, the KV manager and the simulator share this class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

PENDING = -1  # token id placeholder: sampled by the step in flight, not yet on the host


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0  # lower value = served earlier (vLLM convention)
    cache_salt: str | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + output, grows by append_token
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is written in the cache
    num_cached_tokens: int = -1  # prefix-cache hit when first scheduled (-1: not yet scheduled)
    block_ids: list[int] = field(default_factory=list)  # the block table, in order
    num_preemptions: int = 0
    first_scheduled_step: int = -1
    wait_steps: int = 0  # steps spent waiting while others were admitted (lpm aging)
    # Token-level stops, checked by the scheduler as each sampled token lands (stop strings are
    # the engine's: they need text).
    eos_token_ids: frozenset = frozenset()  # empty with ignore_eos
    stop_token_ids: frozenset = frozenset()
    # Prompt logprobs wanted and not all computed yet: every prompt token is a logits row, and the
    # prefix cache is not used for it (its cached blocks would skip those rows; vLLM does the same).
    score_prompt: bool = False
    # Speculative decoding: tokens drafted after token_ids for the next step to verify (the
    # scheduler may drop them when the step has no room; the engine sets them each step).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_known_tokens(self) -> int:
        """Tokens before the trailing PENDING placeholders (with one step in flight, at most two)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] == PENDING:
            n -= 1
        return n

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def stop_for(self, index: int, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
        """Whether the token at `index` of token_ids (just sampled) ends the request: (status,
        stop_reason), else None. EOS and stop tokens are banned on the device before min_tokens."""
        token = self.token_ids[index]
        if token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if index + 1 - len(self.prompt_token_ids) >= self.max_tokens or index + 1 >= max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None

    @property
    def reached_length(self) -> bool:
        """All tokens it may produce are sampled (the last may still be in flight)."""
        return self.num_output_tokens >= self.max_tokens
