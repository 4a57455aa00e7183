"""The output processor: a dispatched step's fetched arrays in, its requests' outputs updated.

For each row: pooling (hidden states), prompt logprobs (scoring rows), the tokens it emits (one,
or each accepted draft and the token after), handed to the scheduler, which says per request
which tokens it kept and the token-level stop it applied; then each kept token's logprobs,
penalty counts, grammar, detokenization and stop strings (sequence.Seq.add_token). An error in
one request's data aborts that request alone (`fail`): its blocks are freed, its output carries
the error, the other requests go on."""

from __future__ import annotations

import logging
import time

from jaxserve.core.request import RequestStatus
from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.planner import Inflight
from jaxserve.sequence import Group, Seq

log = logging.getLogger("jaxserve")


def _top(got, j: int, n: int) -> list[tuple[int, float]]:
    return [(int(a), float(b)) for a, b in zip(got.top_ids[j, :n], got.top_logprobs[j, :n])]


class OutputProcessor:
    def __init__(self, groups: dict[str, Group], seqs: dict[str, Seq], scheduler, eos_token_ids: set[int],
                 counters: dict, speculator=None):
        self.groups = groups  # the engine's: request id -> Group
        self.seqs = seqs  # core request id -> Seq
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.counters = counters
        self.speculator = speculator
        self.failed: dict[str, Group] = {}  # aborted over an error in their own data, not yet output

    def process(self, step: Inflight, got, outputs: dict[str, Group]) -> None:
        """Update the step's requests from its fetched arrays (runner.Fetched)."""
        for i, rows, positions in step.pooled:
            group = self.groups.get(step.seqs[i].group_id)
            try:
                if group is not None:
                    group.pooler.add(positions, got.hidden[rows])
            except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
                self.fail(group.request_id, e, "pooling its hidden states")
        for i, first, pos, count in step.scored:
            try:
                self.score_prompt(step.seqs[i], got, first, pos, count)
            except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
                self.fail(step.seqs[i].group_id, e, "scoring its prompt")
        emitted = self._emitted(step, got)
        sched = step.sched.scheduled
        tokens = got.tokens
        sampled = {sched[i].request.request_id:
                   ([int(tokens[j]) for j in rs] if sched[i].num_draft else int(tokens[rs[0]]))
                   for i, rs in emitted.items()}
        landed = self.scheduler.update_from_output(step.sched, sampled)
        for i, rs in emitted.items():
            seq = step.seqs[i]
            group = self.groups.get(seq.group_id)
            if group is None or seq.out.finished:
                continue
            kept = landed[seq.req.request_id]
            try:
                for m, (j, tok) in enumerate(zip(rs, kept.tokens)):
                    lp = None
                    if seq.out.logprobs is not None:
                        lp = TokenLogprob(tok, float(got.logprobs[j]), _top(got, j, group.params.logprobs))
                    self.append(group, seq, tok, lp, kept.stop if m == len(kept.tokens) - 1 else None)
                    if seq.out.finished:
                        break
            except Exception as e:  # noqa: BLE001 - detokenizing, stop strings, its grammar: it fails alone
                self.fail(group.request_id, e, "reading back its tokens")
                continue
            outputs[group.request_id] = group

    def _emitted(self, step: Inflight, got) -> dict[int, list[int]]:
        """row -> logits rows of the tokens it emits, in order: a verifying row's accepted drafts,
        then the token of the first row that rejects (or the bonus token)."""
        emitted = {}
        for i, sr in enumerate(step.sched.scheduled):
            if not sr.samples or sr.request.is_finished:
                continue
            v = step.verifying.get(sr.request.request_id)
            if v is None:
                emitted[i] = [step.row_of[sr.request.request_id]]
                continue
            first, k = v
            n = next((m for m in range(k) if not got.accepted[first + m]), k)
            emitted[i] = list(range(first, first + n + 1))
            self.speculator.record(k, n)
        return emitted

    def score_prompt(self, seq: Seq, got, first: int, pos: int, count: int) -> None:
        """Prompt logprobs from logits rows first.. (positions pos..: each scores the next token)."""
        group = self.groups.get(seq.group_id)
        if group is None or not seq.req.score_prompt:
            return
        n = group.params.prompt_logprobs
        rows = slice(first, first + count)
        group.prompt_logprobs.fill(pos + 1, got.verify_logprobs[rows], got.top_ids[rows, :n],
                                   got.top_logprobs[rows, :n])
        if group.prompt_logprobs.missing == 0:
            seq.req.score_prompt = False  # from now on it is an ordinary request (cache included)

    def append(self, group: Group, seq: Seq, token: int, lp: TokenLogprob | None, stop) -> None:
        """Record a sampled token; `stop` is the scheduler's token-level verdict (status, reason)."""
        now = time.time()
        m = group.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        self.counters["generation_tokens"] += 1
        stop = seq.add_token(token, lp, stop, group.params, self.eos_token_ids)
        if stop is not None:
            self.finish(group, seq, *stop)

    def finish(self, group: Group, seq: Seq, status: RequestStatus, stop_reason) -> None:
        seq.finish(status, stop_reason)
        if not seq.req.is_finished:
            self.scheduler.finish_request(seq.req, status)
        if group.finished:
            group.metrics.finished_time = time.time()

    def fail(self, group_id: str, error: BaseException, where: str) -> None:
        """Abort one request over an error in its own data: its choices finish ("abort"), its
        blocks are freed, its output carries the error; every other request goes on."""
        group = self.groups.get(group_id)
        if group is None:
            return
        log.error("request %s failed while %s; it is aborted, the engine goes on", group_id, where,
                  exc_info=error)
        group.error = f"The request failed while {where}: {type(error).__name__}: {str(error)[:300]}"
        for seq in group.seqs:
            if not seq.out.finished:
                try:
                    seq.finish(RequestStatus.FINISHED_ABORTED, None)
                except Exception:  # noqa: BLE001 - its detokenizer may be what failed
                    seq.out.finish_reason = "abort"
            if not seq.req.is_finished:
                self.scheduler.finish_request(seq.req, RequestStatus.FINISHED_ABORTED)
        group.metrics.finished_time = time.time()
        self.failed[group_id] = group

    def output(self, group: Group) -> RequestOutput:
        """The group's snapshot; a finished group leaves the engine's tables."""
        out = group.snapshot()
        if out.finished:
            self.groups.pop(group.request_id, None)
            for s in group.seqs:
                self.seqs.pop(s.req.request_id, None)
        return out
