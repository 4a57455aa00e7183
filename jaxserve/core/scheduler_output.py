"""What one scheduling step decided (`SchedulerOutput`: the scheduled rows in batch order, the
preempted and finished requests) and what `Scheduler.update_from_output` did with each request's
sampled tokens (`Landed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request, RequestStatus

@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # request.num_computed_tokens when scheduled; block_ids cover [0, start + num_new_tokens)
    num_tokens: int = -1  # request.num_tokens when scheduled
    num_draft: int = 0  # of num_new_tokens, drafted tokens to verify (request.spec_token_ids[:n])

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = self.request.num_tokens

    @property
    def samples(self) -> bool:
        """This row reaches the end of the known tokens, so it produces the next token(s)."""
        return self.start + self.num_new_tokens - self.num_draft == self.num_tokens


@dataclass(slots=True)
class Landed:
    """What `update_from_output` did with one request's sampled tokens: the tokens it kept, in
    order (those after a stop are dropped), and the token-level stop it applied, if any."""

    tokens: list[int]
    stop: tuple[RequestStatus, int | None] | None = None  # (status, stop_reason)

    @property
    def finished(self) -> bool:
        return self.stop is not None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    preempted: list[Request] = field(default_factory=list)
    # requests the scheduler ended itself: one that alone outgrew the whole KV cache (FINISHED_LENGTH)
    finished: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    step: int = 0
    prefill_cap: int | None = None  # prefill tokens this step could take next to decodes (None: no cap)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not (s.num_new_tokens == 1 and s.samples))

    @property
    def num_decode_tokens(self) -> int:
        return self.num_batched_tokens - self.num_prefill_tokens
