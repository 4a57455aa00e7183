"""Prefix caching with the real model: same greedy tokens for off/hash/radix, and the prompt tokens
actually computed drop by exactly the number of cache hits."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import ENGINE_KW
from tests.test_engine import assert_all_blocks_free

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    system = rng.integers(3, vocab, size=53).tolist()  # 3 full blocks + 5 tokens
    return [system + rng.integers(3, vocab, size=int(rng.integers(1, 30))).tolist() for _ in range(12)]


@pytest.fixture(scope="module")
def runs(tiny_model):
    out = {}
    for kind in ("off", "hash", "radix"):
        for eviction in ("lru", "trunk") if kind != "off" else ("lru",):
            llm = LLM(tiny_model("llama"), prefix_cache=kind, eviction=eviction, **ENGINE_KW)
            prompts = shared_prefix_prompts(llm.engine.model_config.vocab_size)
            first = llm.generate(prompts[:1], P, use_tqdm=False)  # warm the cache with one request
            rest = llm.generate(prompts[1:], P, use_tqdm=False)
            assert_all_blocks_free(llm)
            out[(kind, eviction)] = ([o.outputs[0].token_ids for o in first + rest], llm.engine.get_stats(),
                                     sum(len(p) for p in prompts))
    return out


def test_greedy_outputs_identical_for_every_cache(runs):
    tokens = {k: v[0] for k, v in runs.items()}
    base = tokens[("off", "lru")]
    for k, t in tokens.items():
        assert t == base, f"{k} changed the output"


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_computed_tokens_drop_by_the_hit_count(runs, kind):
    _, off, _ = runs[("off", "lru")]
    _, on, _ = runs[(kind, "lru")]
    assert on["prefix_cache_hits"] >= 11 * 48  # the 3 full shared blocks, for each later request
    assert off["computed_tokens"] - on["computed_tokens"] == on["prefix_cache_hits"]
    assert on["prefix_cache_hits"] % 16 == 0


def test_request_reports_its_cached_tokens(tiny_model):
    llm = LLM(tiny_model("llama"), prefix_cache="radix", **ENGINE_KW)
    prompt = list(range(3, 3 + 40))
    a = llm.generate([prompt], P, use_tqdm=False)[0]
    b = llm.generate([prompt], P, use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 32
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_reset_prefix_cache_forgets_unused_prefixes(tiny_model, kind):
    llm = LLM(tiny_model("llama"), prefix_cache=kind, **ENGINE_KW)
    prompt = list(range(3, 3 + 40))
    llm.generate([prompt], P, use_tqdm=False)
    assert llm.reset_prefix_cache() == 2  # 47 tokens have K/V (the last sampled one never ran): 2 full blocks
    llm.engine.scheduler.kv.check_invariants()
    assert llm.engine.scheduler.kv.cache.num_cached == 0
    again = llm.generate([prompt], P, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_all_blocks_free(llm)


def test_cache_salt_isolates(tiny_model):
    llm = LLM(tiny_model("llama"), prefix_cache="hash", **ENGINE_KW)
    prompt = list(range(3, 3 + 40))
    e = llm.engine
    for rid, salt in (("a", "alice"), ("b", "bob"), ("c", "alice")):
        e.add_request(rid, None, P, prompt_token_ids=prompt, cache_salt=salt)
        cached = None
        while e.has_unfinished_requests():
            for out in e.step():
                cached = out.num_cached_tokens
        assert cached == (32 if rid == "c" else 0), rid
