"""The engine with `--attention-backend pallas` (the TPU kernel in interpret mode on CPU) gives the
same greedy tokens as with the XLA backend, on a tiny model with GQA."""

from __future__ import annotations

from jaxserve import LLM, SamplingParams


def test_pallas_backend_matches_xla_greedy(tiny_model):
    path = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n" * 3, "JAX"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=24)
    want = [o.outputs[0].token_ids for o in LLM(path, attention_backend="xla", **kw).generate(prompts, p, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in LLM(path, attention_backend="pallas", **kw).generate(prompts, p, use_tqdm=False)]
    assert got == want
