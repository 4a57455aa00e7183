"""Admission: a request checked against everything it can size and turned into its sequences
(n > 1: siblings sharing the prompt's cached blocks) before the engine queues it. What passes
here cannot fail later for size (limits.py); a request with a grammar waits here until its
grammar is compiled, and the batch never waits for it."""

from __future__ import annotations

import logging
import random
import time

from jaxserve import limits
from jaxserve.core.request import Request
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.errors import UserError
from jaxserve.outputs import CompletionOutput, PromptLogprobs, RequestMetrics
from jaxserve.pooling import Pooler
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Group, Seq

log = logging.getLogger("jaxserve")


class Admission:
    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: set[int],
                 max_adjustments: int, lookahead: int, score_head, seed: int | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_adjustments = max_adjustments
        self.lookahead = lookahead  # speculative tokens a verification row samples ahead
        self.score_head = score_head  # rerank / score: the LM-head columns, or why there are none
        self._rng = random.Random(seed)

    def group(self, request_id: str, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None,
              arrival_time: float | None, priority: int, cache_salt: str | None) -> Group:
        """The request's sequences, each with its core Request; raises UserError naming the field."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise UserError("The prompt must be a string or a list of token ids.", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ())):
            if (t := max(ids, default=-1)) >= self.vocab_size:
                raise UserError(f"Token id {t} is out of vocabulary (size {self.vocab_size}).", param=name)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.check_row_width(params, len(prompt_token_ids), max_tokens)
        now = time.time() if arrival_time is None else arrival_time
        group = Group(request_id, prompt, prompt_token_ids, params, metrics=RequestMetrics(arrival_time=now),
                      priority=priority, cache_salt=cache_salt)
        eos = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        prompt_set = frozenset(prompt_token_ids) if params.uses_penalties else frozenset()
        want_lp = params.logprobs is not None
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = (params.seed + i) % 2**64 if params.seed is not None else self._rng.getrandbits(64)
            req = Request(rid, list(prompt_token_ids), max_tokens, arrival_time=now, priority=priority,
                          cache_salt=cache_salt, eos_token_ids=eos, stop_token_ids=frozenset(params.stop_token_ids))
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            )
            out = CompletionOutput(index=i, logprobs=[] if want_lp else None,
                                   cumulative_logprob=0.0 if want_lp else None)
            group.seqs.append(Seq(request_id, req, i, seed, detok, out, prompt_set))
        first = group.seqs[0].req
        if params.pooling is not None:
            if params.pooling.score and isinstance(self.score_head, str):
                raise UserError(self.score_head, param="model")
            group.pooler = Pooler(params.pooling, len(prompt_token_ids),
                                  self.score_head if params.pooling.score else None)
            first.score_prompt = params.pooling.every_row and len(prompt_token_ids) > 1
        if params.prompt_logprobs is not None:  # computed once, by the first sequence's prefill
            group.prompt_logprobs = PromptLogprobs(prompt_token_ids, params.prompt_logprobs)
            first.score_prompt = group.prompt_logprobs.missing > 0
        return group

    def check_row_width(self, params: SamplingParams, prompt_len: int, max_tokens: int) -> None:
        """The widest sampling row this request can ever need fits the executable's adjustment
        width, so no later step can fail for its size (limits.py)."""
        bans = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids) \
            if params.min_tokens else set()
        worst = limits.worst_row_adjustments(
            bias_and_bans=len(set(params.logit_bias or ()) | bans), prompt_len=prompt_len,
            max_tokens=max_tokens, penalties=params.uses_penalties,
            repetition=params.repetition_penalty != 1.0, vocab_size=self.vocab_size, lookahead=self.lookahead)
        limits.check_row_width(worst, self.max_adjustments, penalties=params.uses_penalties)

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise UserError("The prompt cannot be empty: send at least one token.", param="prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise UserError(f"Token id {bad} is out of vocabulary (the model's ids are 0..{self.vocab_size - 1}).",
                            param="prompt")
        if len(ids) >= self.max_model_len:
            raise UserError(
                f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                "shorten the prompt or start the engine with a larger --max-model-len.", param="prompt",
            )


class GrammarWait:
    """Requests with a grammar wait here while it compiles on the compiler's threads (cached by
    spec: the server compiles before admission, so this is a cache hit there), then join the
    scheduler (`admit`)."""

    def __init__(self, compiler):
        self.compiler = compiler
        self.waiting: list[tuple[Group, object]] = []  # (group, Future) until compiled

    def add(self, group: Group, spec) -> None:
        future = self.compiler.submit(spec)
        if future.done() and future.exception() is not None:
            raise future.exception()
        self.waiting.append((group, future))

    def admit(self, groups: dict[str, Group], scheduler, outputs: dict[str, Group]) -> None:
        if self.waiting:
            self.waiting = admit_compiled(self.waiting, groups, scheduler, outputs)


def admit_compiled(waiting: list, groups: dict[str, Group], scheduler, outputs: dict[str, Group]) -> list:
    """Requests whose grammar is compiled join the scheduler, each sequence with a matcher; one
    whose grammar failed finishes ("abort") with the error. Returns those still compiling."""
    still = []
    for group, future in waiting:
        if group.request_id not in groups:
            continue  # aborted while compiling
        if not future.done():
            still.append((group, future))
            continue
        error = future.exception()
        for seq in group.seqs:
            if error is not None:
                log.error("request %s: its grammar failed to compile: %s", group.request_id, error)
                seq.out.finish_reason, seq.out.stop_reason = "abort", str(error)
                continue
            seq.matcher = future.result().matcher()
            scheduler.add_request(seq.req)
        if error is not None:
            group.metrics.finished_time = time.time()
            outputs[group.request_id] = group
    return still
