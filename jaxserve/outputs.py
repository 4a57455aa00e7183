"""What the engine hands back per request: vLLM-shaped outputs, with deltas for streaming."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (token id, logprob), best first


class PromptLogprobs(Sequence):
    """One entry per prompt token (the first None), held as arrays while the prefill fills them
    chunk by chunk: a long prompt's top-N are a few numpy arrays, not hundreds of thousands of
    Python objects in the engine's heap (whose garbage collection stalled the server's event
    loop); a TokenLogprob is built when an entry is read, by whoever reads it."""

    def __init__(self, token_ids: list[int], top_n: int):
        p = len(token_ids)
        self.token_ids = token_ids
        self.logprob = np.zeros(p, np.float32)
        self.top_ids = np.zeros((p, top_n), np.int32)
        self.top_logprobs = np.zeros((p, top_n), np.float32)
        self._filled = np.zeros(p, bool)
        self._filled[0] = True  # the first token has no logprob
        self.missing = p - 1  # entries still to come

    def fill(self, start: int, logprob, top_ids, top_logprobs) -> None:
        """Entries start.. from a step's logits rows (each scores the prompt token at its position)."""
        end = start + len(logprob)
        self.missing -= int(np.count_nonzero(~self._filled[start:end]))
        self._filled[start:end] = True
        self.logprob[start:end] = logprob
        self.top_ids[start:end] = top_ids
        self.top_logprobs[start:end] = top_logprobs

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 < i < len(self) or not self._filled[i]:
            if not 0 <= i < len(self):
                raise IndexError(i)
            return None
        return TokenLogprob(self.token_ids[i], float(self.logprob[i]),
                            list(zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist())))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


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
    prompt_logprobs: PromptLogprobs | None = None
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
