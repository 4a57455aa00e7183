"""The step contract end to end: one executable per bucket, nothing compiles after warm-up
whatever mix of sampling parameters arrives, overlap (one step in flight) changes no token, and an
abort while a step is in flight frees every block."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free, mixed_prompts


class CompileCounter:
    """Counts traces to MLIR anywhere in the process (not only the runner's): every new
    compilation lowers first, whether XLA then compiles it or finds it in the persistent cache."""

    EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kw):
        if event in self.EVENTS:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def steady_state_mix(vocab: int) -> list[SamplingParams]:
    """Every sampling feature a server can be asked for, several times, with neutral values too."""
    mix = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=2**40 + 3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, min_p=0.1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.0, top_p=1.0, logprobs=None),
        SamplingParams(max_tokens=10, temperature=0, logit_bias={5: 10.0, 7: -100.0}),
        SamplingParams(max_tokens=10, min_tokens=6, temperature=0.6),
        SamplingParams(max_tokens=10, temperature=0, logprobs=0),
        SamplingParams(max_tokens=10, temperature=0.7, logprobs=3),
        SamplingParams(max_tokens=10, temperature=0, logprobs=20),
        SamplingParams(max_tokens=10, n=3, temperature=0.8, seed=9),
        SamplingParams(max_tokens=10, n=2, temperature=0.5, stop_token_ids=[11]),
    ]
    return mix


@pytest.mark.slow
def test_nothing_compiles_after_warm_up(tiny_model):
    llm = LLM(tiny_model("llama"), **{**ENGINE_KW, "precompile": True})
    runner = llm.engine.runner
    assert runner.num_compiles == len(runner.all_buckets())
    # one sampler executable per (rows, adjustment width), shared by the buckets of those rows
    samplers = {key.sampler() for key in runner.all_buckets()}
    assert len(runner.executables()) == len(runner.all_buckets()) + len(samplers)
    assert len(samplers) < len(runner.all_buckets())
    vocab = llm.engine.model_config.vocab_size
    prompts = mixed_prompts(vocab, n=30, seed=7)
    mix = steady_state_mix(vocab)
    params = [mix[i % len(mix)] for i in range(len(prompts))]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: first dispatch of everything
    with CompileCounter() as compiles:
        for rotate in range(3):  # different mixes in every step, one request alone, all together
            llm.generate(prompts[:1], params[rotate:rotate + 1], use_tqdm=False)
            llm.generate(prompts, params[rotate:] + params[:rotate], use_tqdm=False)
    assert compiles.count == 0, f"{compiles.count} XLA compiles after warm-up"
    assert runner.num_compiles == len(runner.all_buckets())
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def sync_llm(tiny_model):
    return LLM(tiny_model("llama"), **{**ENGINE_KW, "async_scheduling": False})


def test_overlap_changes_no_token(tiny_llm, sync_llm):
    assert tiny_llm.engine.config.async_scheduling and not sync_llm.engine.config.async_scheduling
    vocab = tiny_llm.engine.model_config.vocab_size
    prompts = mixed_prompts(vocab, n=24, seed=3)
    params = [SamplingParams(max_tokens=1 + i % 13, temperature=0, stop_token_ids=[i % 50 + 3]) for i in range(24)]
    params += [SamplingParams(max_tokens=9, temperature=0.8, seed=i, presence_penalty=0.4) for i in range(4)]
    prompts += prompts[:4]
    got = [o.outputs[0] for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in sync_llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.stop_reason for o in got] == [o.stop_reason for o in want]
    assert_all_blocks_free(tiny_llm)


def test_dispatch_counters_see_the_overlap(tiny_llm, sync_llm):
    """Every dispatch is counted once, as queued behind a step still running (hidden host time) or
    onto an idle device; without overlap no step is ever queued behind another. (Whether an
    overlapped step finds the device busy depends on speeds, so only the sums are asserted there.)"""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for llm in (tiny_llm, sync_llm):
        t = llm.engine.timing
        before = (t["dispatch_busy"], t["dispatch_idle"], llm.engine.counters["steps"])
        llm.generate([[5, 6, 7], [9, 10, 11, 12]], params, use_tqdm=False)
        busy, idle, steps = (t["dispatch_busy"] - before[0], t["dispatch_idle"] - before[1],
                             llm.engine.counters["steps"] - before[2])
        assert steps >= 12 and busy + idle == steps
        if not llm.engine.config.async_scheduling:
            assert busy == 0


def test_the_first_step_after_idle_is_read_at_once(tiny_llm):
    """An idle engine reads its first step back before it schedules the next, so the next takes
    every request that arrived meanwhile (a burst reaches the engine one request at a time); from
    the second step on, one step is in flight while the next is scheduled."""
    engine = tiny_llm.engine
    assert not engine.has_unfinished_requests()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("first", None, params, prompt_token_ids=[5, 6, 7])
    outs = engine.step()
    assert [o.request_id for o in outs] == ["first"] and outs[0].outputs[0].delta_token_ids
    assert engine._inflight is None
    engine.add_request("second", None, params, prompt_token_ids=[9, 10, 11, 12])  # came meanwhile
    assert engine.step() == []  # overlapped: dispatched (second's prefill: a burst's go first), not read
    assert "second" in {s.request.request_id for s in engine._inflight.sched.scheduled}
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(tiny_llm)


def test_a_request_that_stopped_emits_nothing_more(tiny_llm):
    """A stop at step n while step n+1 (which includes the request) is in flight: nothing from
    n+1 reaches the output, and the stop token is the last one."""
    engine = tiny_llm.engine
    free = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[3]
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_at
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(tiny_llm)


def test_abort_during_an_inflight_step_frees_every_block(tiny_llm):
    engine = tiny_llm.engine
    for i in range(6):
        engine.add_request(f"inflight-{i}", None, SamplingParams(max_tokens=50, ignore_eos=True, temperature=0),
                           prompt_token_ids=list(range(3, 40 + i)))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None, "overlap keeps one step in flight"
    for i in range(6):
        assert engine.abort_request(f"inflight-{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not out.request_id.startswith("inflight-"), "an aborted request produced output"
    assert_all_blocks_free(tiny_llm)


def test_streamed_outputs_are_deltas(tiny_llm):
    """Unfinished outputs carry only the step's new tokens; the final one carries everything."""
    engine = tiny_llm.engine
    engine.add_request("deltas", None, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
                       prompt_token_ids=[4, 5, 6])
    seen, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            seen += o.delta_token_ids
            if out.finished:
                final = o
            else:
                assert o.token_ids == [] and o.logprobs == []
    assert final is not None and final.token_ids == seen and len(final.logprobs) == 12
