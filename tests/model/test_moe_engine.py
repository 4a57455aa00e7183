"""A mixture-of-experts model through the engine's other features (issue 27): n-gram speculative
decoding, preemption, an int8 KV cache and structured outputs give what the plain engine gives
(greedy), with every block back at the end. One tiny Qwen3-MoE, one plain reference run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free
from tests.test_speculative import NGRAM, repetitive_prompts

GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)
KW = {**ENGINE_KW, "max_num_seqs": 4, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def moe(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def reference(moe):
    from jaxserve import LLM, SamplingParams

    llm = LLM(moe, **KW)
    prompts = repetitive_prompts(4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_moe_speculative_and_preempted_keeps_greedy_tokens(moe, reference):
    """n-gram drafts verified on a cache too small for all four requests (preemption)."""
    from jaxserve import LLM, SamplingParams

    prompts, want = reference
    llm = LLM(moe, **{**KW, "num_blocks": 8, "prefix_cache": "off"}, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.engine.get_stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["preemptions"] > 0, stats
    assert_all_blocks_free(llm)


def test_moe_int8_kv_and_structured_output(moe, reference):
    from jaxserve import LLM, SamplingParams

    prompts, want = reference
    llm = LLM(moe, **KW, kv_cache_dtype="int8")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    same = sum(o.outputs[0].token_ids[:4] == w[:4] for o, w in zip(outs, want))
    assert same >= 3, "int8 KV should rarely change a tiny model's first greedy tokens"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0.8, seed=3,
                                             structured_outputs={"json": schema}), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert set(json.loads(out.outputs[0].text)) == {"n"}
    assert_all_blocks_free(llm)


# Every other MoE family, Gemma 3 and gpt-oss (issues 27 and 28: "the same under preemption"): four
# concurrent greedy requests on a KV cache of 112 tokens (each alone fits; together they do not)
# give the tokens each gives alone on the same engine, with no preemption; every block comes back.
# gpt-oss: 4-token blocks (its sliding window of 8 spans blocks), the same 112 tokens of cache.
PREEMPT = {
    "qwen2_moe": ("qwen2_moe", {}, {}),
    "mixtral": ("mixtral", {}, {}),
    "glm4_moe": ("glm4_moe", {}, {}),
    "gemma3": ("gemma3", {}, {}),  # 2 layers: one sliding (window 20), one global
    "gpt_oss": ("gpt_oss", {}, {"block_size": 4, "num_blocks": 29}),
}


@pytest.mark.parametrize("family", list(PREEMPT))
def test_greedy_identical_under_preemption(tiny_model, family):
    from jaxserve import LLM, SamplingParams

    arch, model_kw, engine_kw = PREEMPT[family]
    llm = LLM(tiny_model(arch, **model_kw), **{**KW, "num_blocks": 8, "prefix_cache": "off", **engine_kw})
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(4)]
    sp = SamplingParams(**GREEDY)
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.engine.get_stats()["preemptions"] == 0
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.engine.get_stats()["preemptions"] > 0, "the cache was meant to force preemptions"
    assert together == alone, f"{family}: greedy tokens differ under preemption"
    assert all(len(t) == GREEDY["max_tokens"] for t in together)
    assert_all_blocks_free(llm)
