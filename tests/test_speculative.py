"""Speculative decoding end to end (n-gram and draft-model proposals): greedy outputs are the
same with speculation on and off under batching, chunked prefill and preemptions, every block
comes back, stops inside an accepted run end the request there, and logprobs, n > 1, grammars
and aborts work while drafts are verified."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import UserError
from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span (as an edit or a quote does), and some that do not."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        span = rng.integers(3, 300, size=int(rng.integers(4, 20))).tolist()
        out.append(span * int(rng.integers(2, 4)) if i % 4 else rng.integers(3, 300, size=30).tolist())
    return out


def params(n: int, seed: int = 0) -> list[SamplingParams]:
    rng = np.random.default_rng(seed + 1)
    return [SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0, ignore_eos=True) for _ in range(n)]


@pytest.fixture(scope="module")
def plain(tiny_llm):
    prompts, ps = repetitive_prompts(64), params(64)
    return prompts, ps, [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, ps, use_tqdm=False)]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(num_blocks=24, prefix_cache="off"),  # preemptions
    dict(num_blocks=24, prefix_cache="hash", max_num_batched_tokens=16),  # small chunks too
], ids=["batched", "preempting", "preempting-small-chunks"])
def test_ngram_greedy_equals_plain_for_64_requests(tiny_model, plain, kw):
    prompts, ps, want = plain
    llm = LLM(tiny_model("llama"), **{**ENGINE_KW, **kw}, speculative_config=NGRAM)
    outs = llm.generate(prompts, ps, use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.outputs[0].token_ids == w, f"request {i} differs with speculation"
    stats = llm.engine.get_stats()
    assert stats["spec_verifications"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert sum(stats["spec_acceptance_counts"]) == stats["spec_verifications"]
    if "preempting" in str(kw) or kw.get("num_blocks"):
        assert stats["preemptions"] > 0
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def draft_pair(tiny_model):
    """A 2-layer target and a 1-layer draft, random-init, sharing the tokenizer."""
    return tiny_model("llama"), tiny_model("llama", layers=1, seed=7)


def test_draft_model_greedy_equals_plain(draft_pair, plain):
    target, draft = draft_pair
    prompts, ps, want = (x[:24] for x in plain)  # 24 of the 64: 16 blocks still preempt
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    llm = LLM(target, **{**ENGINE_KW, "num_blocks": 16, "prefix_cache": "hash"}, speculative_config=spec)
    outs = llm.generate(prompts, ps, use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.outputs[0].token_ids == w, f"request {i} differs with a draft model"
    stats = llm.engine.get_stats()
    assert stats["spec_verifications"] > 0 and stats["preemptions"] > 0
    assert_all_blocks_free(llm)


def test_the_target_as_its_own_draft_is_always_accepted(draft_pair, plain):
    """With the draft equal to the target every greedy draft is right: this holds only if the
    draft's mirrored KV cache is exact (prefills, prefix-cache hits, verified rows)."""
    target, _ = draft_pair
    prompts, _, want = plain
    spec = {"method": "draft", "model": target, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    llm = LLM(target, **ENGINE_KW, speculative_config=spec)
    sp = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts[:8] + prompts[:4], sp, use_tqdm=False)  # repeats hit the prefix cache
    ref = llm.generate(prompts[:8], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:8]] == [o.outputs[0].token_ids for o in ref]
    st = llm.engine.get_stats()
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"] > 0, st
    assert st["prefix_cache_hits"] > 0


def test_a_stop_inside_an_accepted_run_ends_the_request_there(tiny_llm, tiny_model):
    prompt = list(range(10, 20)) * 4
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = tiny_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    llm = LLM(tiny_model("llama"), **ENGINE_KW, speculative_config=NGRAM)
    for cut in (3, 7, 12):
        stop_id = full.token_ids[cut]
        first = full.token_ids.index(stop_id)
        o = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
        assert o.token_ids == full.token_ids[:first + 1] and o.finish_reason == "stop"
        text = tiny_llm.engine.tokenizer.decode(full.token_ids[cut:cut + 2])
        o = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[text]),
                         use_tqdm=False)[0].outputs[0]
        assert text not in o.text and full.text.startswith(o.text)
    for max_tokens in (1, 2, 5, 11):  # never more than max_tokens, whatever was accepted
        o = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        assert o.token_ids == full.token_ids[:max_tokens]
    assert llm.engine.get_stats()["spec_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_logprobs_n_and_seeds_with_speculation(tiny_llm, tiny_model):
    prompt = list(range(30, 45)) * 3
    llm = LLM(tiny_model("llama"), **ENGINE_KW, speculative_config=NGRAM)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    a = tiny_llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    b = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-5)
    assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in x.top] for x in b.logprobs]
    seeded = SamplingParams(n=3, max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    one = llm.generate([prompt], seeded, use_tqdm=False)[0]
    two = llm.generate([prompt], seeded, use_tqdm=False)[0]
    assert [o.token_ids for o in one.outputs] == [o.token_ids for o in two.outputs]  # seeds reproduce
    assert all(len(o.token_ids) == 20 for o in one.outputs)
    assert_all_blocks_free(llm)


def test_structured_output_under_speculation(tiny_model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    prompt = list(range(50, 60)) * 3
    sp = SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": schema})
    plain = LLM(tiny_model("llama"), **ENGINE_KW).generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    llm = LLM(tiny_model("llama"), **ENGINE_KW, speculative_config=NGRAM)
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == plain.token_ids
    if got.finish_reason == "stop":
        jsonschema.validate(json.loads(got.text), schema)
    assert_all_blocks_free(llm)


def test_abort_while_verifying_frees_everything(tiny_model):
    llm = LLM(tiny_model("llama"), **ENGINE_KW, speculative_config=NGRAM)
    eng = llm.engine
    for i, p in enumerate(repetitive_prompts(6, seed=3)):
        eng.add_request(str(i), None, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
                        prompt_token_ids=p)
    for _ in range(6):
        eng.step()
    for i in range(6):
        eng.abort_request(str(i))
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("bad,match", [
    ('{"method": "medusa"}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "draft"}', "model"),
    ('{"method": "ngram", "k": 3}', "Unknown"),
    ("not json at all: [", "JSON object"),
])
def test_bad_speculative_config_is_one_clear_error(bad, match):
    from jaxserve.config import EngineConfig

    with pytest.raises(UserError, match=match):
        EngineConfig(speculative_config=bad)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    from tests.tiny_models import make_tiny_model

    import transformers

    other = make_tiny_model(tmp_path / "other", "llama", layers=1)
    cfg = transformers.AutoConfig.from_pretrained(other)
    cfg.vocab_size += 64
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "wide")
    with pytest.raises(UserError, match="tokenizer"):
        LLM(tiny_model("llama"), **ENGINE_KW, speculative_config={"method": "draft", "model": str(tmp_path / "wide")})
