"""Issue 31 at the engine: a request is refused at admission when its sampling row could ever
outgrow the executable's adjustment width (it used to pass, then kill the engine loop a few
tokens later), and a row that fails anyway fails its own request, never the loop."""

from __future__ import annotations

import pytest

from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams

# A padded vocabulary (2048 rows, 384 tokenizer tokens) wider than the adjustment row:
# max_model_len 64 -> width next_pow2(64 + 512) = 1024.
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=32, block_size=16)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model("llama", vocab_size=2048), **ENGINE))
    assert eng.runner.builder.max_adjustments == 1024
    return eng


def run(eng, max_steps: int = 200) -> dict:
    outs = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    eng.scheduler.kv.check_invariants()
    assert eng.scheduler.kv.num_available_blocks == eng.scheduler.kv.num_blocks - 1
    return outs


def test_logit_bias_past_the_row_is_400_at_admission(engine):
    bias = {t: 1.0 for t in range(1025)}
    with pytest.raises(UserError) as e:
        engine.add_request("wide", "hi", SamplingParams(logit_bias=bias, max_tokens=4))
    assert e.value.param == "logit_bias" and "1024" in e.value.message
    assert engine.num_requests == 0


def test_penalties_that_would_outgrow_the_row_are_refused(engine):
    """The second killer: presence_penalty + a large bias passed validation, then the penalised
    output tokens pushed the row past its width mid-generation."""
    bias = {t: 0.5 for t in range(1000)}
    with pytest.raises(UserError) as e:
        engine.add_request("pen", "hi", SamplingParams(logit_bias=bias, presence_penalty=0.5, max_tokens=40))
    assert e.value.param == "logit_bias"
    # bans before min_tokens count too
    with pytest.raises(UserError):
        engine.add_request("ban", "hi", SamplingParams(logit_bias={t: 0.5 for t in range(1024)},
                                                       stop_token_ids=[1500], min_tokens=1, max_tokens=2))


def test_admitted_worst_case_runs_and_a_failing_row_fails_alone(engine, monkeypatch):
    bias = {t: 0.5 for t in range(1000)}
    # 1000 bias + 20 penalised output tokens <= 1024: admitted, and it must run to the end
    engine.add_request("ok", "hi", SamplingParams(logit_bias=bias, presence_penalty=0.5, max_tokens=20,
                                                  ignore_eos=True, temperature=0))
    # a request that slips past admission (checked off here) fails alone inside the step
    monkeypatch.setattr(engine.admission, "check_row_width", lambda *a: None)
    engine.add_request("bad", "hi", SamplingParams(logit_bias={t: 0.5 for t in range(1100)}, max_tokens=4))
    monkeypatch.undo()
    outs = run(engine)
    assert outs["ok"].error is None and len(outs["ok"].outputs[0].token_ids) == 20
    assert outs["bad"].error and "exceed" in outs["bad"].error
    assert outs["bad"].outputs[0].finish_reason == "abort"
