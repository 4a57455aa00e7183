"""Routed experts kept packed (runtime/expert_matmul.py) in a running model: a GGUF MoE file's
stacked Q4_K / Q6_K (Q4_K_M's mix) and Q8_0 experts stay in their blocks under --quantization
gguf, and the model gives its dequantized float twin's logits (the same values, summed in the same
order: 1e-5 of the logit scale) and greedy tokens; --quantization w8a8 / w4a8 / bfloat16 turn float
experts into their formats (within their quantization error of the float model), and the weights'
bytes are the packed experts' (bits per expert weight checked). That the native grouped call is the
dense kernel's bits per expert, and the xla path its sums: tests/kernels/test_expert_matmul.py.
Under tensor parallelism the stacks are padded to whole panels / blocks per device (checked here
without devices; the engine at TP / EP 2: tests/parallel/test_expert_parallel.py)."""

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


def _stack(rng, e, k, n, quantization):
    return weight_formats.stack_experts([weight_formats.quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.1,
                                                                 quantization) for _ in range(e)])


def moe_config(hidden: int, inter: int):
    """A one-layer config with 2 routed experts (what the padding reads: its MoE layers, EP or not)."""
    from jaxserve.model.config import ModelConfig

    return ModelConfig("qwen3_moe", vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=hidden // 2, num_experts=2, moe_intermediate_size=inter,
                       moe_layers=(0,))


def test_stack_intermediate_whole_panels_and_blocks():
    """I per layer padded so each device holds whole gate / up panels (64) and whole down blocks
    (32; a K-quant's 256): Qwen3-30B-A3B's I = 768 at TP 8."""
    from jaxserve.model.expert_padding import stack_intermediate

    def experts(gate_up, down):
        shape = jax.ShapeDtypeStruct((2, 64, 64), np.float32)
        one = lambda q: shape if q is None else jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _stack(np.random.default_rng(0), 1, 256, 64, q))
        return {"gate_proj": one(gate_up), "up_proj": one(gate_up), "down_proj": one(down)}

    assert stack_intermediate(experts("q8_0", "q8_0"), 768, 8) == 1024  # 96 per device -> 2 panels
    assert stack_intermediate(experts("q4_k", "q6_k"), 768, 8) == 2048  # one super-block of K per device
    assert stack_intermediate(experts("w8a8", "w8a8"), 768, 4) == 768  # 192: whole panels already
    assert stack_intermediate(experts(None, "q8_0"), 96, 3) == 96  # float gate / up: down's 32-blocks only
    assert stack_intermediate(experts(None, None), 768, 8) == 768 and stack_intermediate(experts("q8_0", "q8_0"),
                                                                                        768, 1) == 768


@pytest.mark.parametrize("quantization,inter", [("q8_0", 192), ("w8a8", 192), ("w4a8", 192), ("bfloat16", 192),
                                                ("int8", 192), ("q4_k", 256)])
def test_pad_expert_stacks_decode_to_zeros(quantization, inter):
    """TP 2 over I = 192 (3 panels) or a K-quant's I = 256 (one super-block): padded to 256 / 512;
    each expert decodes to its matrix with zero columns (gate / up) or zero rows (down) appended;
    the parts' specs (sharded_ops.weight_spec) split whole panels / blocks, whole experts under EP."""
    import dataclasses

    from jax.sharding import PartitionSpec as P

    from jaxserve.model.expert_padding import pad_expert_stacks
    from jaxserve.runtime.sharded_ops import weight_spec

    rng = np.random.default_rng(1)
    experts = {p: _stack(rng, 2, 256, inter, quantization) for p in ("gate_proj", "up_proj")}
    experts["down_proj"] = _stack(rng, 2, inter, 256, quantization)
    cfg = moe_config(256, inter)
    params = {"layers_0": {"mlp": {"experts": experts}}}
    assert pad_expert_stacks(params, dataclasses.replace(cfg, expert_parallel=True), 2) is params  # whole experts
    padded = pad_expert_stacks(params, cfg, 2)["layers_0"]["mlp"]["experts"]
    size = 512 if quantization == "q4_k" else 256
    for name, w in padded.items():
        assert type(w.w) is type(experts[name].w)
        for e in range(2):
            got, want = np.asarray(w.expert(e)), np.asarray(experts[name].expert(e))
            if name == "down_proj":
                assert got.shape == (size, 256)
                np.testing.assert_array_equal(got[:inter], want)
                np.testing.assert_array_equal(got[inter:], 0)
            else:
                assert got.shape == (256, size)
                np.testing.assert_array_equal(got[:, :inter], want)
                np.testing.assert_array_equal(got[:, inter:], 0)
        specs = weight_spec(w, name == "down_proj", False)
        for a, spec in zip(w.w, specs.w):
            if name != "down_proj":
                assert spec == P(None, "model") and a.shape[1] % 2 == 0
            elif a.ndim >= 3:
                assert spec == P(None, None, "model") and a.shape[2] % 2 == 0
            else:
                assert spec == P()  # a per-channel scale [E, H]
        assert all(s == P("model") for s in weight_spec(w, name == "down_proj", True).w)


def test_mxfp4a8_split_on_intermediate_axis_is_a_clear_error():

    from jaxserve.errors import UserError
    from jaxserve.model.expert_padding import pad_expert_stacks
    from jaxserve.runtime import mxfp4

    w = jax.ShapeDtypeStruct((2, 1, 8, 256), np.uint8), jax.ShapeDtypeStruct((2, 1, 2, 64), np.uint8)
    stack = weight_formats.ExpertStack(mxfp4.Mxfp4A8Weight(*w))
    cfg = moe_config(64, 64)
    params = {"layers_0": {"mlp": {"experts": {"gate_proj": stack, "up_proj": stack, "down_proj": stack}}}}
    with pytest.raises(UserError, match=r"mxfp4a8 keeps MXFP4 experts whole.*tensor_parallel_size=2 add "
                                        r"--enable-expert-parallel"):
        pad_expert_stacks(params, cfg, 2)
