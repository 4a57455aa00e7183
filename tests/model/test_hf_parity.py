"""Numerical parity with HF transformers (torch, float32) on random-init models of each family.

Logits: a prompt crossing block boundaries is prefilled in chunks, then decoded token by token;
the final-position logits of the prefill and of every decode step must match transformers' full
forward pass. Greedy: 32 tokens identical to transformers' generate().
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.core.batch import RowSpec, Sampling
from jaxserve.worker.runner import ModelRunner, RunnerConfig

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
BS = 16


def hf_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy(), m


def hf_model(path):
    """transformers' float32 model with eager attention (the reference for windows, sinks, soft caps)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def assert_greedy_matches_hf(llm, path: str, prompt: str, max_new_tokens: int, min_hits: int) -> None:
    """The engine's greedy tokens equal transformers' generate(), and again after a prefix-cache hit."""
    import torch

    from jaxserve import SamplingParams

    ids = llm.get_tokenizer().encode(prompt)
    with torch.no_grad():
        ref = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == ref, "greedy tokens differ from transformers"
    assert second == ref, "greedy tokens differ after a prefix-cache hit"
    assert llm.engine.get_stats()["prefix_cache_hits"] >= min_hits


def run_logits(runner: ModelRunner, ids, start, n, blocks):
    batch, key, _ = runner.builder.build([RowSpec(ids, start, n, blocks, Sampling())])
    return np.asarray(runner.forward_logits(batch, key))[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    rng = np.random.default_rng(1)
    lm = load_model(path)
    ids = rng.integers(3, lm.config.vocab_size, size=49).tolist()  # 40-token prompt + 9 decodes
    ref, _ = hf_logits(path, ids)
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32))
    blocks = [7, 3, 11, 5]  # deliberately not contiguous
    scale = np.abs(ref).max()
    got = [run_logits(runner, ids, 0, 32, blocks), run_logits(runner, ids, 32, 8, blocks)]  # chunked prefill
    want = [ref[31], ref[39]]
    for p in range(40, 49):  # decode steps
        got.append(run_logits(runner, ids, p, 1, blocks))
        want.append(ref[p])
    err = np.abs(np.stack(got) - np.stack(want)).max() / scale
    assert err <= 1e-3, f"{arch}: max abs logit diff {err:.2e} relative to logit scale"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch):
    import torch

    from jaxserve import LLM, SamplingParams

    path = tiny_model(arch)
    llm = LLM(path, precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=32)
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n" * 2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    _, model = hf_logits(path, [1, 2])
    for prompt, out in zip(prompts, outs):
        ids = llm.get_tokenizer().encode(prompt)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, f"{arch}: greedy tokens differ for {prompt!r}"
