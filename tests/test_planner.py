"""The step planner and the batch builder without a model (issue 25): decode rows first, a
verification row per draft, prompt-scoring rows, min_tokens bans, n > 1 siblings, a failing row
failing its request alone, and a builder that never changes its input rows."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.batch import BatchBuilder, RowSpec, Sampling
from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import ScheduledRequest
from jaxserve.outputs import CompletionOutput, RequestMetrics
from jaxserve.planner import StepPlanner
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Group, Seq

EOS = 2


def builder() -> BatchBuilder:
    return BatchBuilder(max_num_batched_tokens=64, max_num_seqs=16, block_size=4, max_model_len=64, vocab_size=100)


def planner() -> StepPlanner:
    return StepPlanner(builder(), vocab_size=100, eos_token_ids={EOS})


def group(rid: str, prompt: list[int], params: SamplingParams, outputs: list[int] = ()) -> Group:
    g = Group(rid, None, prompt, params, metrics=RequestMetrics(arrival_time=0.0))
    for i in range(params.n):
        req = Request(rid if params.n == 1 else f"{rid}#{i}", list(prompt), 32)
        req.token_ids += list(outputs)
        req.num_computed_tokens = len(req.token_ids) - 1
        req.block_ids = [1, 2, 3]
        g.seqs.append(Seq(rid, req, i, seed=100 + i, detok=None, out=CompletionOutput(index=i),
                          prompt_set=frozenset(prompt) if params.uses_penalties else frozenset()))
    return g


def tables(*groups: Group):
    return ({s.req.request_id: s for g in groups for s in g.seqs}, {g.request_id: g for g in groups})


def decode(seq: Seq) -> ScheduledRequest:
    return ScheduledRequest(seq.req, 1, len(seq.req.token_ids) - 1)


def test_decode_rows_first_in_a_stable_order():
    a, b, c = (group(r, [5, 6, 7, 8], SamplingParams()) for r in "abc")
    prefill = ScheduledRequest(b.seqs[0].req, 4, 0)
    order = StepPlanner.order([decode(a.seqs[0]), prefill, decode(c.seqs[0])])
    assert [s.request.request_id for s in order] == ["a", "c", "b"]


def test_rows_for_decode_prefill_chunk_and_overlap():
    a = group("a", [5, 6, 7], SamplingParams(temperature=0.5, logprobs=2), outputs=[9])
    b = group("b", [5, 6, 7, 8, 9, 10], SamplingParams())
    seqs, groups = tables(a, b)
    chunk = ScheduledRequest(b.seqs[0].req, 4, 0)  # not up to the last token: it does not sample
    failed = []
    rows, kept, scheduled = planner().plan([decode(a.seqs[0]), chunk], seqs, groups, {"a": 3},
                                           lambda *e: failed.append(e))
    assert not failed and kept == [a.seqs[0], b.seqs[0]] and scheduled[1] is chunk
    r = rows[0]
    assert (r.start, r.num_new, r.prev_index) == (3, 1, 3)  # its token comes from row 3 of the step in flight
    assert r.sampling.temperature == 0.5 and r.sampling.num_logprobs == 2 and r.sampling.seed == 100
    assert r.sampling.step == 1  # the output index it samples
    assert rows[1].sampling is None and rows[1].extra == []
    assert a.metrics.first_scheduled_time is not None


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    p = SamplingParams(min_tokens=2, stop_token_ids=[7], logit_bias={4: 1.5})
    before, after = group("x", [5, 6], p, outputs=[9]), group("y", [5, 6], p, outputs=[9, 9])
    pl = planner()
    s = pl.sampling(p, before.seqs[0])
    assert s.bias == {4: 1.5, EOS: -np.inf, 7: -np.inf}
    assert pl.sampling(p, after.seqs[0]).bias == {4: 1.5}
    assert pl.sampling(SamplingParams(min_tokens=2, ignore_eos=True), before.seqs[0]).bias == {}


def test_verification_row_samples_each_draft_as_if_output():
    p = SamplingParams(presence_penalty=0.5, min_tokens=3)
    g = group("d", [5, 6], p, outputs=[9])
    seq = g.seqs[0]
    seq.counts = {9: 1}
    seq.req.spec_token_ids = [11, 12]
    sr = ScheduledRequest(seq.req, 3, 2, num_draft=2)  # the last token and two drafts
    (row,), _, _ = planner().plan([sr], *tables(g), {}, lambda *e: None)
    assert row.token_ids == [5, 6, 9, 11, 12] and row.prev_index == -1
    assert [off for off, _ in row.extra] == [0, 1]  # a logits row at the last token and at the first draft
    steps = [smp.step for _, smp in row.extra] + [row.sampling.step]
    assert steps == [1, 2, 3]
    assert [smp.output_counts for _, smp in row.extra] == [{9: 1}, {9: 1, 11: 1}]
    assert row.sampling.output_counts == {9: 1, 11: 1, 12: 1} and seq.counts == {9: 1}  # not changed
    assert EOS in row.extra[1][1].bias and EOS not in row.sampling.bias  # min_tokens reached at the bonus row


def test_prompt_scoring_rows_and_siblings():
    p = SamplingParams(n=2, prompt_logprobs=3)
    g = group("s", [5, 6, 7, 8], p)
    first, second = g.seqs
    first.req.score_prompt = True
    first.req.num_computed_tokens = second.req.num_computed_tokens = 0
    scheduled = [ScheduledRequest(first.req, 4, 0), ScheduledRequest(second.req, 4, 0)]
    rows, _, _ = planner().plan(scheduled, *tables(g), {}, lambda *e: None)
    assert [off for off, _ in rows[0].extra] == [0, 1, 2]  # each prompt token that predicts the next
    assert all(smp.num_logprobs == 3 for _, smp in rows[0].extra)
    assert rows[1].extra == []  # computed once, by the first sequence
    assert rows[0].sampling.seed != rows[1].sampling.seed


def test_a_row_that_fails_fails_its_request_and_siblings_alone():
    pl = StepPlanner(BatchBuilder(max_num_batched_tokens=64, max_num_seqs=16, block_size=4, max_model_len=64,
                                  vocab_size=5000), 5000, {EOS})
    width = pl.builder.max_adjustments
    wide = group("wide", [5, 6], SamplingParams(n=2, logit_bias={t: 1.0 for t in range(width + 1)}))
    ok = group("ok", [5, 6], SamplingParams())
    failed = []

    def fail(gid, error, where):
        failed.append(gid)
        for s in wide.seqs:
            s.req.status = s.req.status.FINISHED_ABORTED

    scheduled = [decode(wide.seqs[0]), decode(ok.seqs[0]), decode(wide.seqs[1])]
    rows, seqs, kept = pl.plan(scheduled, *tables(wide, ok), {}, fail)
    assert failed == ["wide"] and seqs == [ok.seqs[0]] and len(rows) == 1 and kept == [scheduled[1]]


sampling = st.builds(Sampling, temperature=st.sampled_from([0.0, 0.7]), num_logprobs=st.sampled_from([-1, 2]),
                     bias=st.dictionaries(st.integers(0, 99), st.floats(-5, 5), max_size=3))


@st.composite
def rows(draw):
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(2, 9))
        ids = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
        start = draw(st.integers(0, n - 1))
        num_new = n - start
        samples = draw(st.booleans())
        extra_offsets = draw(st.lists(st.integers(0, max(num_new - 2, 0)), max_size=2, unique=True)) \
            if num_new >= 2 else []
        extra = [(o, draw(sampling)) for o in sorted(extra_offsets)] if samples else []
        out.append(RowSpec(ids, start, num_new, [1, 2, 3], draw(sampling) if samples else None, extra=extra))
    return out


@settings(max_examples=60, deadline=None)
@given(rows())
def test_build_never_changes_its_rows_and_maps_every_logits_row(rs):
    before = copy.deepcopy(rs)
    batch, key, rowmap = builder().build(rs)
    assert rs == before
    row = 0
    for r, first, out in zip(rs, rowmap.first, rowmap.out):
        assert first == row
        row += len(r.extra)
        assert out == (row if r.sampling is not None else -1)
        row += r.sampling is not None
    assert int(batch.num_logits[0]) == row
