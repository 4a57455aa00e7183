"""A request's host-side output state: its completions (sequences), what each sampled token does
to them (logprobs, penalty counts, grammar, detokenization, stop strings), and the snapshots the
engine hands out. The scheduler's side of a request is `core.request.Request`; this is the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from jaxserve.core.request import Request, RequestStatus
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, TokenLogprob
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger("jaxserve")

Stop = tuple[RequestStatus, "int | str | None"]  # (finished status, stop_reason)


@dataclass(eq=False)
class Seq:
    """One completion (choice) of a request; its core Request is what the scheduler sees."""

    group_id: str
    req: Request
    index: int
    seed: int
    detok: IncrementalDetokenizer
    out: CompletionOutput
    prompt_set: frozenset = frozenset()  # for the repetition penalty
    counts: dict = field(default_factory=dict)  # output token counts, for penalties
    matcher: object | None = None  # structured.matcher.Matcher: its place in the grammar
    spec_wait: int = 0  # speculative decoding: steps until it drafts again (backs off on misses)
    spec_misses: int = 0

    def add_token(self, token: int, lp: TokenLogprob | None, stop: Stop | None, params: SamplingParams,
                  eos_token_ids: set[int]) -> Stop | None:
        """Record a sampled token. `stop` is the scheduler's token-level verdict; returns whether
        (and how) the sequence ends with this token, adding the grammar's and the stop strings'."""
        out = self.out
        out.token_ids.append(token)
        out.delta_token_ids.append(token)
        if params.uses_penalties:
            self.counts[token] = self.counts.get(token, 0) + 1
        if lp is not None:
            out.logprobs.append(lp)
            out.delta_logprobs.append(lp)
            out.cumulative_logprob += lp.logprob
        if self.matcher is not None:
            if token in eos_token_ids:  # the mask allows EOS only where the grammar is complete
                stop = stop or (RequestStatus.FINISHED_STOPPED, None)  # (under ignore_eos too)
            elif not self.matcher.accept(token):
                log.error("request %s: token %d is outside its grammar", self.group_id, token)
                stop = stop or (RequestStatus.FINISHED_STOPPED, None)
            elif self.matcher.is_terminated():  # complete: nothing but EOS can follow; keep the token
                out.delta_text += self.detok.add(token)
                return RequestStatus.FINISHED_STOPPED, None
        if stop is not None and stop[0] == RequestStatus.FINISHED_STOPPED:
            return stop  # EOS or a stop token: never part of the text
        out.delta_text += self.detok.add(token)
        if self.detok.stopped and len(out.token_ids) >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED, self.detok.stop_str
        return stop

    def finish(self, status: RequestStatus, stop_reason) -> None:
        out = self.out
        if not self.detok.stopped:
            out.delta_text += self.detok.flush()
        out.text = self.detok.text
        out.finish_reason = status.finish_reason
        out.stop_reason = stop_reason


@dataclass(eq=False)
class Group:
    """The sequences of one request (n of them), sharing its prompt and parameters."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Seq] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # filled as the prefill runs
    error: str | None = None  # why the engine aborted this request (an error in its own data)
    pooler: object | None = None  # pooling.Pooler of a pooling request

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.seqs)

    def snapshot(self) -> RequestOutput:
        """An output for the consumer (the server's event loop may read it a step later), taking
        the deltas. An unfinished output carries only this step's deltas (token_ids and logprobs
        lists are empty; `logprobs` is [] rather than None when asked for), so a request's host
        work stays linear in its length; the final output carries everything."""
        outs = []
        cached = 0
        for s in self.seqs:
            o = s.out
            if o.finish_reason is not None:
                lps = list(o.logprobs) if o.logprobs is not None else None
                outs.append(CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob, lps,
                                             o.finish_reason, o.stop_reason, o.delta_text,
                                             o.delta_token_ids, o.delta_logprobs))
            else:  # positional: this runs per request per step
                outs.append(CompletionOutput(o.index, "", [], o.cumulative_logprob,
                                             [] if o.logprobs is not None else None, None, None,
                                             o.delta_text, o.delta_token_ids, o.delta_logprobs))
            o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
            cached = max(cached, s.req.num_cached_tokens)
        lps = self.prompt_logprobs
        prompt_lps = lps if lps is not None and lps.missing == 0 else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             cached, self.metrics.copy(), prompt_lps, self.error,
                             self.pooler.value if self.pooler is not None else None)
