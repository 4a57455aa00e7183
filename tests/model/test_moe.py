"""Mixture-of-experts models against transformers (float32): Qwen3-MoE (top-k renormalised),
GLM-4.5 (sigmoid routing with correction bias and expert groups, shared expert, partial RoPE),
Qwen2-MoE (not renormalised, shared expert with its sigmoid gate, a dense layer in the mix) and
Mixtral. Logits under chunked prefill and decode; greedy tokens through the engine with chunked
prefill and a prefix-cache hit. The router and grouped matmul's edge cases are in test_moe_ops.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_hf_parity import BS, hf_logits, run_logits

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_logits_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    lm = load_model(path)
    assert lm.config.is_moe and lm.config.num_experts in (4, 8)
    ids = np.random.default_rng(1).integers(3, lm.config.vocab_size, size=45).tolist()  # 40 prompt + 5 decodes
    ref, _ = hf_logits(path, ids)
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32))
    blocks = [7, 3, 11, 5]
    got = [run_logits(runner, ids, 0, 32, blocks), run_logits(runner, ids, 32, 8, blocks)]  # chunked prefill
    want = [ref[31], ref[39]]
    for p in range(40, 45):
        got.append(run_logits(runner, ids, p, 1, blocks))
        want.append(ref[p])
    err = np.abs(np.stack(got) - np.stack(want)).max() / np.abs(ref).max()
    assert err <= 1e-4, f"{arch}: max abs logit diff {err:.2e} relative to logit scale"


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_greedy_chunked_and_cached(tiny_model, arch):
    """Greedy tokens equal transformers' generate(); the prompt (> 40 tokens) is prefilled in
    16-token chunks, and the second round reuses its cached blocks."""
    import torch

    from jaxserve import LLM, SamplingParams

    path = tiny_model(arch)
    llm = LLM(path, precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=32,
              prefix_cache="hash")
    prompt = "The capital of France is Paris. The capital of Italy is Rome. def add(a, b):\n    return a + b\n" * 2
    ids = llm.get_tokenizer().encode(prompt)
    assert 40 < len(ids) < 100
    _, model = hf_logits(path, [1, 2])
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == ref, f"{arch}: greedy tokens differ from transformers"
    assert second == ref, f"{arch}: greedy tokens differ after a prefix-cache hit"
    assert llm.engine.get_stats()["prefix_cache_hits"] >= 32
