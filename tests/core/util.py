"""A tiny engine loop for scheduler tests: fake sampled tokens; the scheduler finishes at max_tokens."""

from __future__ import annotations

import random

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput


def step(sched: Scheduler, rng: random.Random, vocab: int = 5, check: bool = True) -> SchedulerOutput:
    out = sched.schedule()
    if check:
        sched.kv.check_invariants()
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request twice in one batch"
    assert not {r.request_id for r in out.preempted} & set(ids), "preempted and scheduled"
    for s in out.scheduled:
        assert len(s.request.block_ids) * sched.config.block_size >= s.start + s.num_new_tokens
    sched.dispatched(out)
    sampled = {s.request.request_id: rng.randrange(vocab) for s in out.scheduled if s.samples}
    landed = sched.update_from_output(out, sampled)
    assert landed.keys() == sampled.keys()
    for rid, kept in landed.items():
        assert kept.tokens == [sampled[rid]]
        if kept.finished:  # the scheduler ends requests at max_tokens itself
            r = next(s.request for s in out.scheduled if s.request.request_id == rid)
            assert kept.stop[0] == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
    if check:
        sched.kv.check_invariants()
    return out


def run(sched: Scheduler, reqs: list[Request] = (), seed: int = 0, max_steps: int = 100_000,
        check: bool = True) -> list[SchedulerOutput]:
    rng = random.Random(seed)
    for r in reqs:
        sched.add_request(r)
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched, rng, check=check))
        assert len(outs) < max_steps, "no progress"
    return outs
