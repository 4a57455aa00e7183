"""Scheduler behaviour a user of the engine would notice: budgets, chunking, preemption, errors."""

import random

import pytest

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.growth import RETRACT_DECODE_STEPS
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import ADMISSIONS, SchedulerConfig

from .util import run, step


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    base.update(kw)
    return SchedulerConfig(**base)


def mixed_requests(n: int, seed: int = 0, vocab: int = 4, shared: int = 12) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [
        Request(
            f"r{i}",
            prefix[: rng.randrange(0, shared)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
            max_tokens=rng.randrange(1, 30),
            arrival_time=float(i),
            priority=rng.randrange(3),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("bad,match", [
    (dict(num_blocks=1), "num_blocks"),
    (dict(prefix_cache="lru"), "prefix_cache"),
    (dict(eviction="lfu"), "eviction"),
    (dict(policy="sjf"), "policy"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(admission="greedy"), "admission"),
    (dict(init_new_token_ratio=1.5), "init_new_token_ratio"),
])
def test_config_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        cfg(**bad)


@pytest.mark.parametrize("prefix_cache", ["off", "hash", "radix"])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
@pytest.mark.parametrize("prefill_first", [False, True])
@pytest.mark.parametrize("admission", ADMISSIONS)
def test_budget_cap_and_all_blocks_free_at_the_end(prefix_cache, policy, prefill_first, admission):
    c = cfg(num_blocks=40, prefix_cache=prefix_cache, policy=policy, prefill_first=prefill_first,
            admission=admission)
    sched = Scheduler(c)
    reqs = mixed_requests(30)
    outs = run(sched, reqs)
    for out in outs:
        assert out.num_batched_tokens <= c.max_num_batched_tokens
        assert len(out.scheduled) <= c.max_num_seqs
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
    st = sched.stats()
    assert st["blocks_used"] == 0 and st["blocks_free"] + st["blocks_cached"] == c.num_blocks - 1
    if admission == "optimistic":  # (conservative admission mostly makes them wait instead)
        assert st["preemptions"] > 0  # 39 blocks for 30 requests: memory pressure happened
    assert not sched.has_unfinished_requests() and sched.num_running == sched.num_waiting == 0


def test_seq_cap_limits_batch():
    sched = Scheduler(cfg(max_num_seqs=3, max_num_batched_tokens=512))
    for i in range(10):
        sched.add_request(Request(f"r{i}", [1, 2, 3], 5))
    out = sched.schedule()
    assert len(out.scheduled) == 3 and sched.num_running == 3 and sched.num_waiting == 7


def test_chunked_prefill_and_decode_mix():
    sched = Scheduler(cfg(max_num_batched_tokens=32, prefix_cache="off", burst_prefill_first=False))
    long = Request("long", list(range(100)), 3)
    sched.add_request(long)
    rng = random.Random(0)
    chunks = []
    for _ in range(4):
        out = step(sched, rng)
        (s,) = out.scheduled
        chunks.append((s.start, s.num_new_tokens, s.samples))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert long.num_output_tokens == 1
    sched.add_request(Request("short", list(range(50)), 2))
    out = step(sched, rng)
    # decode-first: the running request's decode token comes first, then a 31-token chunk
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 1), ("short", 31)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 31


def test_a_burst_is_prefilled_alone_and_its_decodes_wait_for_its_last_chunk():
    # 2 decoding, 3 prompts arrive (a burst: 3 waiting for their first token >= 2 decoding): the
    # chunks fill the steps and every decode waits, once, until the burst's chunks are all done
    sched = Scheduler(cfg(max_num_batched_tokens=32, prefix_cache="off"))
    rng = random.Random(0)
    for r in (Request("a", list(range(10)), 20), Request("b", list(range(10, 20)), 20)):
        sched.add_request(r)
    assert step(sched, rng).num_prefill_tokens == 20
    assert step(sched, rng).num_decode_tokens == 2
    for i in range(3):
        sched.add_request(Request(f"p{i}", list(range(100 * i, 100 * i + 30)), 5))
    rows = [(o.num_prefill_tokens, o.num_decode_tokens) for o in (step(sched, rng) for _ in range(4))]
    # 90 prompt tokens: 32 + 32 prefill-only steps (p0's first token came in the first: it waits
    # too), then the last 26 alone though 6 tokens of budget are left, then the 5 decodes
    assert rows[:2] == [(32, 0), (32, 0)]
    assert rows[2] == (26, 0) and rows[3] == (0, 5) and not sched.burst.active


def test_a_prompt_arriving_beside_more_decodes_is_no_burst():
    sched = Scheduler(cfg(max_num_batched_tokens=32, prefix_cache="off"))
    rng = random.Random(0)
    for i in range(3):
        sched.add_request(Request(f"d{i}", list(range(10 * i, 10 * i + 10)), 20))
    step(sched, rng)
    sched.add_request(Request("long", list(range(100, 200)), 5))
    out = step(sched, rng)  # decode-first: 3 decodes, then 29 tokens of the prompt
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (3, 29) and not sched.burst.active


def test_preemption_is_counted_and_requests_keep_their_place():
    # 9 usable blocks of 4 tokens; three requests of 8 prompt tokens that grow to 20 tokens each
    sched = Scheduler(cfg(num_blocks=10, prefix_cache="off", max_num_batched_tokens=64))
    reqs = [Request(f"r{i}", [i] * 8, 12, arrival_time=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    rng = random.Random(0)
    preempted = []
    while sched.has_unfinished_requests():
        before = list(sched.running)
        out = step(sched, rng)
        preempted += out.preempted
        if out.preempted:
            # the victim is the latest arrival among the running, and it goes to the front of the queue
            assert out.preempted[0] is max(before, key=lambda r: r.arrival_time)
            sched.add_request(Request(f"late{len(preempted)}", [9] * 8, 1, arrival_time=100))
            assert list(sched.waiting)[0] is out.preempted[-1]
    assert preempted and sched.stats()["preemptions"] == len(preempted)
    assert reqs[2].num_preemptions >= 1
    for r in reqs:  # output tokens are kept across preemption, none lost or doubled
        assert r.num_output_tokens == 12


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_conservative_admission_keeps_room_for_the_running_requests_growth(admission):
    # 14 usable blocks of 4 tokens. a (4 + 40 tokens, 11 blocks at the end) runs; b (8 + 40 tokens)
    # fits now on its prompt, but both cannot reach max_tokens together
    sched = Scheduler(cfg(num_blocks=15, prefix_cache="off", admission=admission))
    a = Request("a", [1] * 4, 40, arrival_time=0)
    b = Request("b", [2] * 8, 40, arrival_time=1)
    rng = random.Random(0)
    sched.add_request(a)
    step(sched, rng)
    sched.add_request(b)
    step(sched, rng)
    if admission == "optimistic":  # b goes in, and is preempted once a has grown into its room
        assert b.status == RequestStatus.RUNNING
        run(sched)
        assert b.num_preemptions >= 1
    else:  # b waits for a, and nobody is preempted
        assert b.status == RequestStatus.WAITING and sched.stats()["blocks_free"] >= 2 + 6
        run(sched)
        assert sched.num_preemptions == 0 and a.first_scheduled_step < b.first_scheduled_step
    assert a.num_output_tokens == b.num_output_tokens == 40


def test_new_token_ratio_rises_after_a_preemption_so_the_victim_is_not_preempted_again():
    # init ratio 0: admission only counts prompts, like optimistic, until the first preemption;
    # then the ratio is re-estimated from the survivors and admission leaves them room to finish
    reqs = [Request(f"r{i}", [i] * 8, 24, arrival_time=i) for i in range(6)]
    sched = Scheduler(cfg(num_blocks=20, prefix_cache="off", max_num_batched_tokens=64,
                          admission="conservative", init_new_token_ratio=0.0))
    rng = random.Random(0)
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        out = step(sched, rng)
        if out.preempted:
            rs = sched.running
            want = (sum(r.num_output_tokens for r in rs) + RETRACT_DECODE_STEPS * len(rs)) / (
                sum(r.max_tokens for r in rs) + 1)
            assert sched.new_token_ratio == pytest.approx(min(1.0, want))
    assert sched.num_preemptions >= 1
    assert max(r.num_preemptions for r in reqs) == 1
    # optimistic admission on the same requests preempts one of them again and again
    again = [Request(f"r{i}", [i] * 8, 24, arrival_time=i) for i in range(6)]
    run(Scheduler(cfg(num_blocks=20, prefix_cache="off", max_num_batched_tokens=64)), again)
    assert max(r.num_preemptions for r in again) > 1


def test_preempted_request_does_not_stay_in_the_batch():
    # priority policy: the victim (worst priority) may already be in this step's batch
    sched = Scheduler(cfg(num_blocks=6, prefix_cache="off", policy="priority", max_num_batched_tokens=64))
    lo = Request("lo", [1] * 7, 20, priority=5)  # scheduled first (it is running first)
    hi = Request("hi", [2] * 7, 20, priority=0)
    rng = random.Random(0)
    sched.add_request(lo)
    step(sched, rng)
    sched.add_request(hi)
    saw = False
    while sched.has_unfinished_requests():
        out = step(sched, rng)
        if out.preempted:
            saw = True
            assert lo in out.preempted and lo not in [s.request for s in out.scheduled]
            assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert saw


def test_over_long_requests_are_rejected_and_do_not_block_the_queue():
    sched = Scheduler(cfg(num_blocks=9, max_model_len=64))  # 8 usable blocks = 32 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("too-long", [1] * 64, 1))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(Request("too-big", [1] * 32, 1))  # 32 + 1 tokens need 9 blocks
    with pytest.raises(ValueError, match="prompt cannot be empty"):
        sched.add_request(Request("empty", [], 1))
    assert sched.num_waiting == 0
    ok = Request("ok", [1] * 31, 1)
    run(sched, [ok])
    assert ok.num_output_tokens == 1


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_request_that_alone_outgrows_the_cache_is_finished_not_looped(admission):
    # conservative admission expects it to grow far beyond the cache: alone, it is admitted anyway
    sched = Scheduler(cfg(num_blocks=4, max_model_len=256, prefix_cache="off", admission=admission))
    req = Request("grows", [1] * 8, 100)
    outs = run(sched, [req])
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 13  # 12 with K/V + 1 sampled
    assert any(req in o.finished for o in outs)


def test_abort_waiting_and_running():
    sched = Scheduler(cfg(max_num_seqs=1))
    a, b = Request("a", [1, 2, 3], 5), Request("b", [1, 2, 3], 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, random.Random(0))
    assert sched.abort_request("b") and b.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("a") and a.status == RequestStatus.FINISHED_ABORTED
    assert not sched.abort_request("a")
    assert not sched.has_unfinished_requests()
    sched.kv.check_invariants()
    assert sched.stats()["blocks_used"] == 0


def test_priority_order():
    sched = Scheduler(cfg(policy="priority", max_num_seqs=1))
    for i, p in enumerate([3, 1, 2]):
        sched.add_request(Request(f"p{p}", [i + 1] * 3, 1, priority=p, arrival_time=i))
    order = [o.scheduled[0].request.request_id for o in run(sched) if o.scheduled]
    assert order == ["p1", "p2", "p3"]


def test_prefix_hit_on_second_request_and_stats():
    sched = Scheduler(cfg(prefix_cache="radix", block_size=4))
    prompt = list(range(20))
    a = Request("a", prompt, 2)
    run(sched, [a])
    b = Request("b", prompt + [7], 2)
    run(sched, [b])
    assert b.num_cached_tokens == 20
    st = sched.stats()
    assert st["prefix_cache_hits"] == 20 and st["prefix_cache_queries"] == 41
    assert st["prefix_cache_hit_blocks"] == 5 and st["hit_rate"] == pytest.approx(20 / 41)


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_in_batch_dedup_computes_a_shared_new_prefix_once(prefix_cache):
    prompt = list(range(64))
    def computed(dedup: bool) -> int:
        sched = Scheduler(cfg(prefix_cache=prefix_cache, dedup_in_batch=dedup, max_num_batched_tokens=512,
                              num_blocks=128))
        run(sched, [Request(f"r{i}", prompt + [100 + i], 1) for i in range(4)])
        return sched.stats()["num_computed_prompt_tokens"]
    assert computed(False) == 4 * 65
    assert computed(True) == 65 + 3 * 1


def test_lpm_prefers_cached_prefix_and_does_not_starve():
    c = cfg(policy="lpm", max_num_seqs=1, max_num_batched_tokens=256, lpm_max_wait_steps=5, num_blocks=128)
    sched = Scheduler(c)
    warm = list(range(40))
    rng = random.Random(0)
    run(sched, [Request("seed", warm + [1], 1)])
    cold = Request("cold", [200 + i for i in range(30)], 1)
    sched.add_request(cold)
    for i in range(3):
        sched.add_request(Request(f"w{i}", warm + [50 + i], 1))
    first = step(sched, rng)
    assert first.scheduled[0].request.request_id.startswith("w")  # warm one jumps the queue
    # a steady stream of warm requests: the cold one still gets in within a bounded number of steps
    steps = 1
    while cold.status == RequestStatus.WAITING:
        sched.add_request(Request(f"x{steps}", warm + [60 + steps], 1))
        step(sched, rng)
        steps += 1
        assert steps < 3 * (c.lpm_max_wait_steps + 2), "cold request starved"
    run(sched)


def test_lpm_falls_back_to_fcfs_on_long_queues():
    sched = Scheduler(cfg(policy="lpm", lpm_max_queue=2, max_num_seqs=1, num_blocks=128))
    run(sched, [Request("seed", list(range(40)), 1)])
    reqs = [Request("cold", [99] * 5, 1)] + [Request(f"w{i}", list(range(40)) + [i], 1) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    assert step(sched, random.Random(0)).scheduled[0].request.request_id == "cold"


def _prefilled(sched: Scheduler, req: Request):
    """Schedule `req` until its prompt is computed; returns the step in which it samples."""
    sched.add_request(req)
    while True:
        out = sched.schedule()
        sched.dispatched(out)
        if any(s.samples for s in out.scheduled):
            return out
        sched.update_from_output(out, {})


@pytest.mark.parametrize("sampled,kept,status,reason", [
    ([5], [5], None, None),  # an ordinary token: kept, no stop
    ([7], [7], RequestStatus.FINISHED_STOPPED, 7),  # a stop token id: kept, the stop is the token
    ([2], [2], RequestStatus.FINISHED_STOPPED, None),  # EOS
    ([5, 6, 7, 5], [5, 6, 7], RequestStatus.FINISHED_STOPPED, 7),  # a verify row: cut after the stop
    ([5, 6, 5, 6, 5], [5, 6, 5, 6], RequestStatus.FINISHED_LENGTH, None),  # max_tokens=4 reached
])
def test_update_from_output_says_what_it_kept_and_the_stop(sampled, kept, status, reason):
    sched = Scheduler(cfg())
    req = Request("a", [1, 1, 1], max_tokens=4, eos_token_ids=frozenset({2}), stop_token_ids=frozenset({7}))
    out = _prefilled(sched, req)
    landed = sched.update_from_output(out, {"a": sampled if len(sampled) > 1 else sampled[0]})
    assert list(landed) == ["a"]
    assert landed["a"].tokens == kept and req.output_token_ids == kept
    assert landed["a"].stop == (None if status is None else (status, reason))
    assert req.is_finished == (status is not None)
    sched.kv.check_invariants()


def test_update_from_output_asserts_every_sampling_row_brings_its_token():
    sched = Scheduler(cfg())
    out = _prefilled(sched, Request("a", [1, 1, 1], max_tokens=4))
    with pytest.raises(KeyError):
        sched.update_from_output(out, {})
