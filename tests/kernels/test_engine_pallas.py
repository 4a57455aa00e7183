"""The engine with `--attention-backend pallas` (the TPU kernel in interpret mode on CPU) gives the
same greedy tokens as with the XLA backend, on a tiny model with GQA."""

from __future__ import annotations

from jaxserve import LLM, SamplingParams


def test_pallas_backend_matches_xla_greedy(tiny_model):
    path = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n" * 3, "JAX"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=24)
    want = [o.outputs[0].token_ids
            for o in LLM(path, attention_backend="xla", **kw).generate(prompts, p, use_tqdm=False)]
    got = [o.outputs[0].token_ids
           for o in LLM(path, attention_backend="pallas", **kw).generate(prompts, p, use_tqdm=False)]
    assert got == want


def test_pallas_backend_int8_kv_matches_xla_greedy(tiny_model):
    """int8 KV through the TPU kernel (interpreted) and its quantizing fused write vs the xla path
    over int8 paged KV: the same bytes and scales are stored (one quantize), and the kernels differ
    only in float32 summation order, so greedy tokens are equal on this model (no near-ties)."""
    path = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n" * 3]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # one prefill step for both prompts (the longer spans two blocks), then decode steps
    kw = dict(precompile=False, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=64, num_blocks=8,
              block_size=32, kv_cache_dtype="int8")
    want = [o.outputs[0].token_ids
            for o in LLM(path, attention_backend="xla", **kw).generate(prompts, p, use_tqdm=False)]
    llm = LLM(path, attention_backend="pallas", **kw)
    assert llm.engine.runner.backend.kv_layout == "tpu-fused"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    assert got == want
