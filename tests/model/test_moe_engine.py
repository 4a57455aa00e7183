"""A mixture-of-experts model through the engine's other features (issue 27): n-gram and draft-model
speculative decoding, preemption, an int8 KV cache and structured outputs give what the plain engine
gives (greedy), with every block back at the end; the step contract (one executable per bucket,
nothing compiled while serving) holds. One tiny Qwen3-MoE, one plain reference run. Then every
other MoE family, Gemma 3 and gpt-oss under preemption."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free, mixed_prompts
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


def test_moe_draft_model_speculation_keeps_greedy_tokens(moe, reference):
    """Draft-model speculation with the MoE target: the target as its own draft (the same tokenizer),
    3 drafts a step verified as 4 rows a request in one target step, on a cache that forces
    preemptions, prefix caching on. Every greedy draft must then be accepted, which holds only if
    the verified rows' logits and the draft's mirrored KV cache are exact (a random draft would be
    rejected at its first token here, leaving the multi-row verification unchecked)."""
    from jaxserve import LLM, SamplingParams

    prompts, want = reference
    spec = {"method": "draft", "model": moe, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    llm = LLM(moe, **{**KW, "num_blocks": 8, "prefix_cache": "hash"}, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.engine.get_stats()
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0 and stats["preemptions"] > 0, stats
    assert_all_blocks_free(llm)


def test_moe_nothing_compiles_while_serving(moe):
    """tests/test_step_contract.py's contract for an MoE model: precompiled, one executable per
    bucket; then requests of many lengths (1..69 tokens, alone and 15 together) with every sampling
    feature: no XLA compile anywhere in the process."""
    from jaxserve import LLM
    from tests.test_step_contract import CompileCounter, steady_state_mix

    llm = LLM(moe, precompile=True, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=32)
    runner = llm.engine.runner
    assert runner.num_compiles == len(runner.all_buckets())
    samplers = {key.sampler() for key in runner.all_buckets()}
    assert len(runner.executables()) == len(runner.all_buckets()) + len(samplers)
    vocab = llm.engine.model_config.vocab_size
    mix = steady_state_mix(vocab)
    prompts = mixed_prompts(vocab, n=len(mix), seed=5)
    llm.generate(prompts[:2], mix[:2], use_tqdm=False)  # warm-up: first dispatch of everything
    with CompileCounter() as compiles:
        llm.generate(prompts[-1:], mix[-1:], use_tqdm=False)
        llm.generate(prompts, mix[3:] + mix[:3], use_tqdm=False)
    assert compiles.count == 0, f"{compiles.count} XLA compiles while serving"
    assert runner.num_compiles == len(runner.all_buckets())
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
