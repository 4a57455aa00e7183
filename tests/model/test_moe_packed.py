"""Routed experts kept packed (runtime/expert_matmul.py) in a running model: a GGUF MoE file's
stacked Q4_K / Q6_K (Q4_K_M's mix) and Q8_0 experts stay in their blocks under --quantization
gguf, and the model gives its dequantized float twin's logits (the same values, summed in the same
order: 1e-5 of the logit scale) and greedy tokens; --quantization w8a8 / w4a8 / bfloat16 turn float
experts into their formats (within their quantization error of the float model), and the weights'
bytes are the packed experts' (bits per expert weight checked). That the native grouped call is the
dense kernel's bits per expert, and the xla path its sums: tests/kernels/test_expert_matmul.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.runtime import weight_formats
from jaxserve.runtime.quant_params import weight_bytes
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_gguf_families import _synthetic_moe
from tests.parallel.test_quant_tp import greedy_logits
from tests.parallel.test_tensor_parallel import BS

PROMPTS = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14]]
PROJ = ("gate_proj", "up_proj", "down_proj")


def runner(lm, quantization=None, backend=None) -> ModelRunner:
    return ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
        quantization=quantization, attention_backend=backend))


def experts(r: ModelRunner) -> dict:
    return {p: r.params["layers_0"]["mlp"]["experts"][p] for p in PROJ}


def bits_per_weight(stacks: dict) -> float:
    weights = sum(int(np.prod(s.shape)) for s in stacks.values())
    return 8 * weight_bytes(stacks) / weights


def test_gguf_experts_kept_packed_match_float(tmp_path):
    """Q4_K gate, Q8_0 up (two formats: two grouped calls, not the fused pair) and Q6_K down experts."""
    path = tmp_path / "moe.gguf"
    _synthetic_moe(path, {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q6_K"})
    packed = runner(load_model(str(path), quantization="gguf"))
    stacks = experts(packed)
    assert [type(s.w).__name__ for s in stacks.values()] == ["Q4KWeight", "Q8Weight", "Q6KWeight"]
    assert all(isinstance(s, weight_formats.ExpertStack) and s.shape[0] == 4 for s in stacks.values())
    # the bytes held: llama.cpp's 4.5 / 8.5 / 6.5625 bits a weight (Q4_K's 6-bit sub-block scales held as bytes)
    bits = [8 * weight_bytes(s) / np.prod(s.shape) for s in stacks.values()]
    np.testing.assert_allclose(bits, [4.625, 8.5, 6.5625], atol=0.01)
    logits, tokens = greedy_logits(packed, PROMPTS, 3)
    ref = runner(load_model(str(path)))  # the same file, experts dequantized to float32 at load
    assert all(isinstance(w, jax.Array) for w in experts(ref).values())
    ref_logits, ref_tokens = greedy_logits(ref, PROMPTS, 3)
    np.testing.assert_array_equal(tokens, ref_tokens)
    scale = np.abs(ref_logits).max()
    np.testing.assert_allclose(logits / scale, ref_logits / scale, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "moe.gguf"
    _synthetic_moe(path, {})  # F32 everywhere
    lm = load_model(str(path))
    return lm, greedy_logits(runner(lm), PROMPTS, 3)


@pytest.mark.parametrize("quantization,kind,bits,tol", [("w8a8", "W8A8Weight", 8.125, 0.03),
                                                        ("w4a8", "W4A8Weight", 5.0, 0.15),
                                                        ("bfloat16", "Bf16Weight", 16.0, 0.01)])
def test_quantized_float_experts(float_moe, quantization, kind, bits, tol):
    lm, (ref_logits, _) = float_moe
    native = runner(lm, quantization)
    assert native.backend.native_linear
    stacks = experts(native)
    assert all(type(s.w).__name__ == kind for s in stacks.values())
    assert bits_per_weight(stacks) <= bits + 0.01
    logits, _ = greedy_logits(native, PROMPTS, 3)
    scale = np.abs(ref_logits).max()
    assert np.abs(logits[0] - ref_logits[0]).max() / scale < tol  # the prefill: quantization error only


def test_float_experts_under_tensor_parallelism():
    """Under TP/EP > 1 (the runner's `float_experts`) a GGUF's kept experts become their float32
    stacks, each expert its dequantized kernel; shapes stay shapes for lowering."""
    from jaxserve.runtime.quant_params import float_experts

    w = np.random.default_rng(0).standard_normal((3, 64, 64)).astype(np.float32)
    stack = weight_formats.stack_experts([weight_formats.quantize(w[e], "q8_0") for e in range(3)])
    norm = w[0, 0]
    out = float_experts({"experts": {"down_proj": stack}, "norm": norm})
    assert out["experts"]["down_proj"].shape == (3, 64, 64) and out["norm"] is norm
    for e in range(3):
        np.testing.assert_array_equal(out["experts"]["down_proj"][e], np.asarray(weight_formats.dequantize(
            weight_formats.expert_at(stack.w, e))))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stack)
    assert float_experts({"x": shapes})["x"] == jax.ShapeDtypeStruct((3, 64, 64), np.float32)
