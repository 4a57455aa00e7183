"""Greedy decoding with the default settings against transformers' float32 forward: a bfloat16
checkpoint on CPU runs with a bfloat16 KV cache on the native kernels, in the format this machine
picks by default (jaxserve/default_format.py: bfloat16 matmul inputs where the CPU has bfloat16 dot
products, else float32), and again pinned to float32 (`quantization="none"`); its greedy tokens may
part from the reference's only where the reference's top two logits are within 0.05 (a near-tie
that bfloat16 K/V storage or bfloat16 matmul inputs may flip). The shipped default model (a Q4_1
GGUF, also bfloat16 KV by default) is held to exact agreement in tests/model/test_default_model.py
(float32) and tests/model/test_quant_model.py (its default gguf format against float32)."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import pytest

from bench import hf_reference
from jaxserve import LLM, SamplingParams
from jaxserve.runtime.cpu_isa import cpu_features

NEW_TOKENS = 32
PROMPTS = ["The capital of France is", "1, 2, 3, 5, 8, 13, 21, 34,", "def add(a, b):\n    return a + b\n" * 4,
           "Once upon a time, in a land far away, there lived a", "x " * 60, "2, 4, 6, 8, 10, 12, 14,"]


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_model, tmp_path_factory):
    """The tiny model (float32 values) declared a bfloat16 checkpoint, so the engine's defaults
    pick a bfloat16 KV cache for it, as for any bfloat16 or GGUF checkpoint."""
    src = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    dst = tmp_path_factory.mktemp("bf16ckpt") / "model"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return src, str(dst)


_REFERENCE: dict = {}  # the transformers reference, computed once for both parametrizations


@pytest.mark.parametrize("quantization", [None, "none"], ids=["default", "float32"])
def test_default_greedy_matches_float32_reference_outside_near_ties(bf16_checkpoint, quantization):
    f32_path, path = bf16_checkpoint
    llm = LLM(path, precompile=False, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64,
              quantization=quantization)
    runner = llm.engine.runner
    assert runner.backend.attention == "cpu" and runner.kv_caches[0][0].dtype == jnp.bfloat16  # the default path
    bf16_dot = bool(cpu_features() & {"avx512_bf16", "amx_bf16"})
    assert llm.engine.quantization == ("bfloat16" if quantization is None and bf16_dot else "none")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    key = tuple(tuple(o.prompt_token_ids) for o in outs)
    if key not in _REFERENCE:
        model = hf_reference.load_float32(f32_path)
        _REFERENCE[key] = hf_reference.greedy(model, [o.prompt_token_ids for o in outs], NEW_TOKENS)
    ref = _REFERENCE[key]
    seen = hf_reference.compare([o.outputs[0].token_ids for o in outs], ref)
    far = [(PROMPTS[i][:20], at, margin) for i, at, margin in seen["far"]]
    assert not far, f"greedy parted from the float32 reference outside near-ties: {far}"
    assert seen["exact"] >= len(PROMPTS) // 2  # the check compares something: most continuations agree in full
