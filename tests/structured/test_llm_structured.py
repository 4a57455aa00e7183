"""The offline API: SamplingParams(structured_outputs=...) through LLM.generate (runs once the
engine applies grammars)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve.sampling_params import SamplingParams
from tests.server.agent_models import ENGINE_SUPPORTS_STRUCTURED, NEEDS_ENGINE
from tests.server.schemas import SCHEMAS

pytestmark = pytest.mark.skipif(not ENGINE_SUPPORTS_STRUCTURED, reason=NEEDS_ENGINE)


def test_generate_under_schema_regex_and_choice(tiny_llm):
    schema = SCHEMAS["array_of_objects"]
    outs = tiny_llm.generate(["a", "b"], SamplingParams(
        n=2, seed=4, max_tokens=120, structured_outputs={"json": schema}))
    for r in outs:
        for o in r.outputs:
            assert o.finish_reason == "stop"
            jsonschema.validate(json.loads(o.text), schema)
    (r,) = tiny_llm.generate(["c"], SamplingParams(
        max_tokens=30, temperature=0, structured_outputs={"regex": r"[0-9]{2}-[a-z]{3}"}))
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", r.outputs[0].text)
    (r,) = tiny_llm.generate(["d"], SamplingParams(
        n=3, max_tokens=30, seed=0, structured_outputs={"choice": ["left", "right"]}))
    assert {o.text for o in r.outputs} <= {"left", "right"}


def test_unconstrained_rows_in_the_same_batch_are_untouched(tiny_llm):
    plain = SamplingParams(max_tokens=8, temperature=0)
    (want,) = tiny_llm.generate(["e"], plain)
    got = tiny_llm.generate(["e", "f"], [plain, SamplingParams(
        max_tokens=8, temperature=0, structured_outputs={"choice": ["yes"]})])
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert got[1].outputs[0].text == "yes"


def test_preempted_constrained_requests_match_alone(tiny_model, tiny_llm):
    """A tiny KV cache forces preemption (recompute); each sequence's grammar state must carry
    over, so seeded outputs equal the same requests run alone, and all validate."""
    from jaxserve import LLM
    from tests.conftest import ENGINE_KW

    schema = SCHEMAS["many_fields"]
    params = [SamplingParams(seed=i, max_tokens=120, structured_outputs={"json": schema})
              for i in range(12)]
    prompts = [f"record {i}: " * 4 for i in range(12)]
    alone = [tiny_llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids
             for p, s in zip(prompts, params)]
    llm = LLM(tiny_model("llama"), **{**ENGINE_KW, "num_blocks": 24, "prefix_cache": "off"})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_stats()["preemptions"] > 0, "the small cache was meant to preempt"
    for out, want in zip(outs, alone):
        assert out.outputs[0].token_ids == want
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
