"""Quantized KV caches in the whole engine under TP=2 (kv heads and their scales sharded over
"model"): prefix caching, preemptions and n-gram speculative decoding on, every block free
afterwards, and greedy agreement with a bfloat16 KV cache over a fixed prompt set, measured as
`jaxserve bench quality` does, teacher-forced: the share of the quantized run's greedy tokens that
the model with a bfloat16 KV cache also picks given the same prefix (free-running texts part ways
after one close call on a random-init model). (8 forced CPU devices: see conftest.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels.kv_quant import QuantPages

KW = dict(precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=10,
          block_size=16, prefix_cache="hash", tensor_parallel_size=2,
          speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 3})
KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 300, size=40).tolist()  # a shared prefix: prefix-cache hits
    out = []
    for i in range(6):
        span = rng.integers(3, 300, size=int(rng.integers(4, 12))).tolist()
        out.append((shared if i % 2 else []) + span * 3)  # repeats: n-gram drafts get accepted
    return out


def run(path, kv: str):
    llm = LLM(path, kv_cache_dtype=kv, **KW)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts(), p, use_tqdm=False)]
    return llm, outs


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def bf16_runner(model):
    """The same model with a bfloat16 KV cache on one device: only its teacher-forced forward runs."""
    return LLM(model, kv_cache_dtype="bfloat16", **{**KW, "tensor_parallel_size": 1, "num_blocks": 16}).engine.runner


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_quantized_kv_engine_tp2(model, bf16_runner, kv):
    from bench.quality import greedy_agreement
    from tests.test_engine import assert_all_blocks_free

    llm, outs = run(model, kv)
    runner = llm.engine.runner
    k = runner.kv_caches[0][0]
    assert isinstance(k, QuantPages) and k.dtype == runner.kv_dtype
    for leaf in jax.tree.leaves(k):  # data and scales each split over their kv heads
        assert len({s.device for s in leaf.addressable_shards}) == 2
        assert {s.data.shape[2] for s in leaf.addressable_shards} == {1}
    stats = llm.engine.get_stats()
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_all_blocks_free(llm)
    agreement = greedy_agreement(bf16_runner, prompts(), outs)
    print(f"{kv}: greedy agreement with bfloat16 KV {agreement:.3f}")
    assert agreement >= 0.9
