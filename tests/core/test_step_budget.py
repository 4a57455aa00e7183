"""The ITL-aware prefill cap: the step budget's fit and the scheduler honouring the cap."""

import random

import pytest

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import SchedulerConfig
from jaxserve.core.step_budget import StepBudget

from .util import run, step


def test_fit_recovers_cost_and_caps_for_the_target():
    b = StepBudget(max_tokens=512, target_s=0.100)
    assert b.cap() is None  # nothing measured yet: no cap
    for i in range(60):  # gap = 40 ms + 0.5 ms per prefill token
        n = (0, 0, 64, 0, 256, 0, 512)[i % 7]
        b.observe(n, 0.040 + 0.0005 * n)
    a, c = b.fit()
    assert a == pytest.approx(0.040, rel=1e-6) and c == pytest.approx(0.0005, rel=1e-6)
    assert b.cap() == 120  # (100 - 40) / 0.5
    assert StepBudget(max_tokens=64, target_s=0.100, decay=b.decay).cap() is None


def test_auto_target_and_bounds():
    b = StepBudget(max_tokens=512)  # auto: 3x a decode-only step
    for n in (0, 200) * 20:
        b.observe(n, 0.050 + 0.001 * n)
    assert b.cap() == 100  # (3 x 50 - 50) / 1
    tight = StepBudget(max_tokens=512, target_s=0.010)
    off = StepBudget(max_tokens=512, target_s=0)
    for n in (0, 200) * 20:
        tight.observe(n, 0.050 + 0.001 * n)
        off.observe(n, 0.050 + 0.001 * n)
    assert tight.cap() == 16  # never below min_chunk: prefills always progress
    assert off.cap() is None


def test_only_mixed_steps_seen_gives_a_safe_cap():
    b = StepBudget(max_tokens=512, target_s=0.2)
    for _ in range(5):
        b.observe(400, 0.4)  # one prefill size: a and c cannot be told apart
    assert b.fit() == (0.0, pytest.approx(0.001))
    assert b.cap() == 200


def _sched(cap):
    s = Scheduler(SchedulerConfig(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=512))
    s.prefill_cap = cap
    return s


@pytest.mark.parametrize("prefill_first", [False, True])
def test_scheduler_caps_prefill_only_next_to_more_decodes(prefill_first):
    sched = _sched(10)
    sched.config.prefill_first = prefill_first
    rng = random.Random(0)
    for i in range(3):
        sched.add_request(Request(f"a{i}", list(range(10 * i, 10 * i + 10)), max_tokens=50))
    first = step(sched, rng)
    assert first.num_batched_tokens == 30 and first.prefill_cap is None  # no decodes yet: full budget
    sched.add_request(Request("b", list(range(100, 150)), max_tokens=50))
    sched.add_request(Request("c", list(range(200, 250)), max_tokens=50))
    for _ in range(10):
        out = step(sched, rng)
        assert out.num_decode_tokens
        if out.prefill_cap is not None:
            assert out.prefill_cap == 10 and out.num_prefill_tokens <= 10
    # 3 decodes and 2 prompts waiting: capped; chunks of at most 10 still finish both prompts
    assert sched.requests["b"].num_output_tokens > 0 and sched.requests["c"].num_output_tokens > 0


def test_a_burst_of_arrivals_is_not_capped():
    sched = _sched(10)
    rng = random.Random(0)
    sched.add_request(Request("a", list(range(10)), max_tokens=50))
    step(sched, rng)
    for i in range(4):  # more prompts waiting than decodes: TTFT first, whole budget
        sched.add_request(Request(f"b{i}", list(range(100 * i, 100 * i + 40)), max_tokens=50))
    out = step(sched, rng)  # and the prompts go first: the decode takes what they leave (nothing)
    assert out.prefill_cap is None and out.num_prefill_tokens == 64 and out.num_decode_tokens == 0
    sched.config.burst_prefill_first = False
    out = step(sched, rng)  # still in the burst (uncapped), decode-first
    assert out.prefill_cap is None and out.scheduled[0].request.request_id == "a"
    assert out.num_decode_tokens >= 1 and out.num_prefill_tokens == 64 - out.num_decode_tokens


def test_uncapped_scheduler_is_unchanged():
    reqs = [Request(f"r{i}", [i] * (20 + 7 * i), max_tokens=5 + i) for i in range(8)]
    capped = run(_sched(None), [Request(r.request_id, list(r.prompt_token_ids), max_tokens=r.max_tokens)
                                for r in reqs])
    wide = run(_sched(64), reqs)  # a cap as large as the budget changes nothing
    assert [o.num_batched_tokens for o in capped] == [o.num_batched_tokens for o in wide]
    assert all(o.prefill_cap is None for o in wide)
