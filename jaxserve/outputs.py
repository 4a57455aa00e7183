"""What the engine hands back per request: vLLM-shaped outputs, with deltas for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (token id, logprob), best first


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # What changed in the last step (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def copy(self) -> "RequestMetrics":  # per request per step: cheaper than dataclasses.replace
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                              self.last_token_time, self.finished_time)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs, once computed: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # set when the engine aborted this request over an error in its own data (its choices end
    # with finish_reason "abort"); the engine itself serves on
    error: str | None = None
    # a pooling request's vector (f32[D], numpy) or reranker score (f32[1]), once its prompt ran
    pooled: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
