"""YaRN RoPE: the frequencies and attention factor against transformers' own computation, and a tiny
Qwen3 with `rope_scaling: yarn` (original context 32) against transformers' float32 forward at
positions past the original context: chunked prefill and decode logits, greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.errors import UserError
from jaxserve.model import rope
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_hf_parity import BS, hf_logits, run_logits


@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=32),
    dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=0.707),  # DeepSeek-style attention factor
    dict(factor=2.0, original_max_position_embeddings=2048, attention_factor=1.25, truncate=False),
])
def test_yarn_frequencies_match_transformers(params):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = dict(rope_type="yarn", rope_theta=50000.0, **params)
    cfg = Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=8192,
                      rope_parameters=dict(rp))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = rope.inv_freq(50000.0, 64, rp, 8192)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_yarn_without_original_context_is_a_user_error():
    with pytest.raises(UserError, match="original_max_position_embeddings"):
        rope.inv_freq(10000.0, 64, {"rope_type": "yarn", "factor": 4.0})


def test_yarn_qwen3_logits_past_original_context(tiny_model):
    path = tiny_model("qwen3_yarn")
    lm = load_model(path)
    assert lm.config.rope_attention_factors()[0] > 1.0  # the factor is in play
    ids = np.random.default_rng(3).integers(3, lm.config.vocab_size, size=70).tolist()  # 64 prompt + 6 decodes
    ref, _ = hf_logits(path, ids)
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32))
    blocks = [7, 3, 11, 5, 9]
    got = [run_logits(runner, ids, 0, 32, blocks), run_logits(runner, ids, 32, 32, blocks)]
    want = [ref[31], ref[63]]
    for p in range(64, 70):  # decode at positions 64..69, twice the original context
        got.append(run_logits(runner, ids, p, 1, blocks))
        want.append(ref[p])
    err = np.abs(np.stack(got) - np.stack(want)).max() / np.abs(ref).max()
    assert err <= 1e-4, f"max abs logit diff {err:.2e} relative to logit scale"


def test_yarn_qwen3_greedy_matches_transformers(tiny_model):
    import torch

    from jaxserve import LLM, SamplingParams

    path = tiny_model("qwen3_yarn")
    llm = LLM(path, precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=32)
    prompt = "The capital of France is Paris. The capital of Italy is Rome. def add(a, b):\n    return a + b\n" * 2
    ids = llm.get_tokenizer().encode(prompt)
    assert 40 < len(ids) < 100
    _, model = hf_logits(path, [1, 2])
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref
