"""The step planner (no jax): the scheduler's output and each request's state in, the step's rows
out, then the padded batch and the record of what to read back.

    ScheduledRequest + Seq -> RowSpec (decode rows first) -> BatchBuilder.build -> (StepBatch, key, RowMap)
                                                           -> Inflight (which logits rows mean what)

A row samples its last token with its request's Sampling; a verification row also has a logits
row per draft (each sampling as if the drafts before it were output already: its step, penalty
counts and min_tokens bans); a prompt-scoring row (prompt logprobs, pooling) has one per prompt
token. A row whose data fails (too wide, a bad token) fails its own request; the rest go on."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from jaxserve.core.batch import BatchBuilder, RowMap, RowSpec, Sampling
from jaxserve.core.buckets import BucketKey
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Group, Seq
from jaxserve.structured.matcher import BitmaskFiller


@dataclass(eq=False)
class Inflight:
    """A dispatched step whose tokens the host has not read yet."""

    sched: SchedulerOutput  # .scheduled in row order
    seqs: list[Seq]  # per row
    result: object  # runner.StepResult (device arrays)
    key: BucketKey
    want_logprobs: bool
    needs_tokens: bool  # a row's sampling needs its last token's value (penalties, grammars, a due draft)
    row_of: dict[str, int]  # request id -> logits row, for rows that sample
    verifying: dict[str, tuple[int, int]]  # request id -> (first logits row, drafts) of verifying rows
    scored: list[tuple[int, int, int, int]]  # prompt logprobs: (row, first logits row, position, count)
    pooled: list[tuple[int, list[int], list[int]]]  # pooling: (row, logits rows, their positions)
    dispatched: float = 0.0  # when it was launched (the step trace's clock)


class StepPlanner:
    def __init__(self, builder: BatchBuilder, vocab_size: int, eos_token_ids: set[int]):
        self.builder = builder
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._bitmask_filler = BitmaskFiller()

    @staticmethod
    def order(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Decode rows (one new token) first: the XLA attention takes them in a loop of their own."""
        return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)

    def sampling(self, p: SamplingParams, seq: Seq, ahead: list[int] = ()) -> Sampling:
        """The row's sampling; `ahead`: drafted tokens before it (a verification row samples as
        if they were output already: its step, penalty counts and min_tokens bans)."""
        n_out = seq.req.num_output_tokens + len(ahead)
        bias = dict(p.logit_bias or {})
        if n_out < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids):
                bias[t] = -np.inf
        counts = {}
        if p.uses_penalties:
            counts = dict(seq.counts) if ahead else seq.counts
            for t in ahead:
                counts[t] = counts.get(t, 0) + 1
        return Sampling(
            temperature=p.temperature, top_k=p.top_k if p.top_k < self.vocab_size else 0,  # all: off
            top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
            step=n_out, num_logprobs=-1 if p.logprobs is None else p.logprobs,
            logprob_ids=tuple(p.logprob_token_ids or ()),
            presence=p.presence_penalty, frequency=p.frequency_penalty, repetition=p.repetition_penalty,
            bias=bias, prompt_tokens=seq.prompt_set if p.uses_penalties else frozenset(),
            output_counts=counts, constrained=seq.matcher is not None,
        )

    def row(self, sr: ScheduledRequest, seq: Seq, group: Group, prev: dict[str, int]) -> RowSpec:
        """One scheduled request's row; `prev`: request id -> its logits row in the step in flight."""
        req, params = sr.request, group.params
        if sr.num_draft:  # verify the drafts: a logits row at the last token and at each draft
            drafts = req.spec_token_ids[:sr.num_draft]
            row = RowSpec(req.token_ids + drafts, sr.start, sr.num_new_tokens, req.block_ids,
                          self.sampling(params, seq, drafts), -1,
                          extra=[(j, self.sampling(params, seq, drafts[:j])) for j in range(len(drafts))])
        else:
            row = RowSpec(req.token_ids, sr.start, sr.num_new_tokens, req.block_ids,
                          self.sampling(params, seq) if sr.samples else None, prev.get(req.request_id, -1))
            if req.score_prompt:  # a logits row at each prompt token that predicts the next one
                score = Sampling(num_logprobs=-1 if group.pooler is not None else params.prompt_logprobs)
                end = min(sr.start + sr.num_new_tokens, len(req.prompt_token_ids) - 1)
                row.extra = [(p - sr.start, score) for p in range(sr.start, end)]
        width = self.builder.max_adjustments
        for _, smp in [(0, row.sampling), *row.extra]:
            if smp is not None and smp.adjusts and smp.num_adjustments() > width:
                raise ValueError(f"{smp.num_adjustments()} logit adjustments exceed the widest row ({width})")
        return row

    def plan(self, scheduled: list[ScheduledRequest], seq_of: dict[str, Seq], group_of: dict[str, Group],
             prev: dict[str, int], fail) -> tuple[list[RowSpec], list[Seq], list[ScheduledRequest]]:
        """The rows of the scheduled requests (in order), with their sequences and scheduled
        entries; a request whose row fails is failed (`fail(group_id, error, where)`) with its
        siblings, and left out."""
        now = time.time()
        rows, seqs, kept = [], [], []
        for sr in scheduled:
            if sr.request.is_finished:  # a sibling's row failed earlier in this loop
                continue
            seq = seq_of[sr.request.request_id]
            group = group_of[seq.group_id]
            group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
            try:
                rows.append(self.row(sr, seq, group, prev))
            except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
                fail(seq.group_id, e, "building its step row")
                continue
            seqs.append(seq)
            kept.append(sr)
        live = [i for i, sr in enumerate(kept) if not sr.request.is_finished]  # a failed group's siblings too
        return [rows[i] for i in live], [seqs[i] for i in live], [kept[i] for i in live]

    def build(self, rows: list[RowSpec], seqs: list[Seq], scheduled: list[ScheduledRequest], fail):
        """The padded batch; a row that cannot be built alone fails its request (`fail(group_id,
        error, where)`), the rest go on (rows, seqs and scheduled are edited in place). Returns
        (batch, key, rowmap), or Nones when no row is left."""
        try:
            return self.builder.build(rows)
        except Exception as first:  # noqa: BLE001 - find the row(s) at fault
            bad = []
            for i, row in enumerate(rows):
                try:
                    self.builder.build([row])
                except Exception as e:  # noqa: BLE001
                    bad.append(i)
                    fail(seqs[i].group_id, e, "building its step")
            if not bad:
                raise first  # not one request's data: the engine's own state is at fault
            keep = [i for i in range(len(rows)) if not scheduled[i].request.is_finished]
            rows[:] = [rows[i] for i in keep]
            seqs[:] = [seqs[i] for i in keep]
            scheduled[:] = [scheduled[i] for i in keep]
            return self.builder.build(rows) if rows else (None, None, None)

    def fill_masks(self, batch, key: BucketKey, rows: list[RowSpec], seqs: list[Seq],
                   scheduled: list[ScheduledRequest], rowmap: RowMap, speculator) -> None:
        """Grammar masks, filled on the host and applied in the executable: a sampling row's from
        its matcher; a verification row's for each draft, from the grammar's state after it."""
        constrained = [None] * key.s
        for seq, sr, out in zip(seqs, scheduled, rowmap.out):
            if out >= 0 and not sr.num_draft:
                constrained[out] = seq.matcher
        if any(m is not None for m in constrained):
            self._bitmask_filler.fill(constrained, batch.bitmask)
        for seq, r, sr, first in zip(seqs, rows, scheduled, rowmap.first):
            if sr.num_draft and seq.matcher is not None:
                speculator.fill_masks(seq.matcher, r.token_ids[-sr.num_draft:], batch.bitmask[first:])

    @staticmethod
    def pool_rows(r: RowSpec, first: int, out: int) -> tuple[list[int], list[int]]:
        """A pooling row's logits rows and the prompt positions they read: its extra rows (every
        token, for mean / CLS pooling), then its last token's when it samples."""
        rows = list(range(first, first + len(r.extra)))
        positions = [r.start + off for off, _ in r.extra]
        if out >= 0:
            rows.append(out)
            positions.append(r.start + r.num_new - 1)
        return rows, positions

    def inflight(self, sched: SchedulerOutput, rows: list[RowSpec], seqs: list[Seq], rowmap: RowMap,
                 result, key: BucketKey, pooling: list[bool], due: list[bool]) -> Inflight:
        """What the host reads back from a dispatched step. pooling / due: per row, its request
        pools / its speculator drafts next step."""
        scheduled = sched.scheduled
        return Inflight(
            sched, seqs, result, key,
            want_logprobs=any((r.sampling is not None and r.sampling.num_logprobs >= 0) or r.extra
                              for r, p in zip(rows, pooling) if not p),
            needs_tokens=any(r.sampling is not None and (r.sampling.uses_penalties or r.sampling.constrained or d)
                             for r, d in zip(rows, due)),
            row_of={sr.request.request_id: out for sr, out in zip(scheduled, rowmap.out) if sr.samples},
            verifying={sr.request.request_id: (first, sr.num_draft)
                       for sr, first in zip(scheduled, rowmap.first) if sr.num_draft},
            scored=[(i, rowmap.first[i], r.start, len(r.extra)) for i, (r, p) in enumerate(zip(rows, pooling))
                    if r.extra and not p],
            pooled=[(i, *self.pool_rows(r, rowmap.first[i], rowmap.out[i])) for i, (r, p) in
                    enumerate(zip(rows, pooling)) if p],
        )
