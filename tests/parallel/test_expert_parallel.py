"""Mixture-of-experts under tensor and expert parallelism (8 forced CPU devices: see conftest.py):
experts split on their intermediate axis (TP) or whole experts per device (EP = TP size, attention
tensor-parallel alongside) give EP=1's greedy tokens and logits; each device holds E / N experts;
impossible layouts and EP on a dense model are clear errors. gpt-oss's MXFP4 experts shard as
whole blocks with their scales, padded on the intermediate axis where the blocks do not split; so
do experts kept in a weight format (a GGUF's K-quant / Q8_0 blocks as stored)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest

from jaxserve.errors import UserError
from jaxserve.model import sharding
from jaxserve.model.loader import load_model
from jaxserve.runtime import mesh as ml
from jaxserve.runtime import expert_matmul, mxfp4, weight_formats
from jaxserve.runtime.quant_params import weight_bytes
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_gguf_families import _synthetic_moe
from tests.model.test_gpt_oss import mxfp4_checkpoints
from tests.parallel.test_quant_tp import greedy_logits
from tests.parallel.test_tensor_parallel import BS, greedy_run

CFG = RunnerConfig(block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)


@pytest.mark.parametrize("arch,layouts", [
    ("qwen3_moe", [(2, False), (2, True), (4, True)]),  # 8 experts: 4 / 2 per device under EP
    ("qwen2_moe", [(2, True)]),  # shared expert (column/row-parallel) and a dense layer beside EP
    ("gpt_oss", [(2, False)]),  # expert biases split with their columns, sinks with their heads (xla attention)
    ("mixtral", [(2, True)]),  # 4 experts: 2 per device
    # sigmoid routing with a correction bias over expert groups, a shared expert, layer 0 dense
    ("glm4_moe", [(2, True)]),
])
def test_ep_same_greedy_tokens(tiny_model, arch, layouts):
    lm = load_model(tiny_model(arch))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, lm.config.vocab_size, n).tolist() for n in (19, 11)]
    ref_logits, ref_tokens = greedy_run(ModelRunner(lm.config, lm.params, CFG), prompts, steps=4)
    for tp, ep in layouts:
        runner = ModelRunner(lm.config, lm.params, dataclasses.replace(
            CFG, tensor_parallel_size=tp, enable_expert_parallel=ep))
        experts = runner.params[f"layers_{lm.config.moe_layers[0]}"]["mlp"]["experts"]["gate_proj"]
        e, h, i = experts.shape
        shard = experts.sharding.shard_shape(experts.shape)
        assert shard == ((e // tp, h, i) if ep else (e, h, i // tp)), (tp, ep, shard)
        logits, tokens = greedy_run(runner, prompts, steps=4)
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{arch} tp={tp} ep={ep}: greedy tokens differ")
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 1e-5, f"{arch} tp={tp} ep={ep}: logits differ by {err:.2e} of their scale"


def test_mxfp4_experts_under_tp_and_ep(tiny_model, tmp_path):
    """A tiny gpt-oss with MXFP4 experts (hidden 32: I = 64, two blocks along down's K) at TP 2 (one
    block per device) and EP 2 (4 whole experts per device) gives TP 1's greedy tokens and logits.
    (The padding a TP that splits blocks needs: tests/model/test_gpt_oss.py, test_lower_gpt_oss.py.)"""
    packed_dir, _ = mxfp4_checkpoints(tiny_model("gpt_oss", hidden=32, kv_heads=4), tmp_path)
    lm = load_model(packed_dir)
    assert lm.config.expert_format == "mxfp4" and lm.config.moe_intermediate_size == 64
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, lm.config.vocab_size, n).tolist() for n in (19, 11)]
    ref_logits, ref_tokens = greedy_run(ModelRunner(lm.config, lm.params, CFG), prompts, steps=4)
    for tp, ep, shards in [(2, False, ((8, 32, 1, 16), (8, 32, 1, 16))), (2, True, ((4, 64, 1, 16), (4, 32, 2, 16)))]:
        runner = ModelRunner(lm.config, lm.params, dataclasses.replace(
            CFG, tensor_parallel_size=tp, enable_expert_parallel=ep))
        experts = runner.params["layers_0"]["mlp"]["experts"]
        assert isinstance(experts["gate_proj"], mxfp4.Mxfp4Weight)
        got = tuple(w.blocks.sharding.shard_shape(w.blocks.shape) for w in (experts["gate_proj"], experts["down_proj"]))
        assert got == shards, (tp, ep, got)
        logits, tokens = greedy_run(runner, prompts, steps=4)
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"mxfp4 tp={tp} ep={ep}: greedy tokens differ")
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 1e-5, f"mxfp4 tp={tp} ep={ep}: logits differ by {err:.2e} of their scale"


@pytest.mark.parametrize("quantization,types,kinds,eps", [
    ("gguf", {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q6_K"},
     ["Q4KWeight", "Q8Weight", "Q6KWeight"], (True, False)),
    ("w8a8", {}, ["W8A8Weight"] * 3, (False,)),  # EP's whole experts: the same path whatever the format
])
def test_packed_experts_under_tp_and_ep(tmp_path, quantization, types, kinds, eps):
    """Experts in a weight format (hidden = I = 256, 4 experts, 1 layer) stay packed at TP 2 and EP 2
    (w8a8: TP 2 only) and give TP 1's greedy tokens and logits. gguf: a GGUF's Q4_K gate, Q8_0 up and Q6_K down experts
    (Q4_K_M's mix) as stored; w8a8: float experts quantized at load (and the attention's matrices).
    The same decoded values (w8a8: the same int8 activations, blocks of 32 along K never split) in
    another sum order: the native grouped kernels on each device's shard (under shard_map; the
    dense layers in XLA's partitioned dot under TP), TP's down projection in two partial sums, so
    float32 rounding only (1e-5 of the logit scale).
    EP 2: two whole experts per device, half the stacks' bytes. TP 2: Q6_K down's K = 256 is one
    super-block, which two devices cannot share, so the GGUF's I is padded to 512 (zero blocks;
    model/expert_padding.py `stack_intermediate`): each device holds one super-block of K and 4 of the 8
    gate / up panels; w8a8's 4 panels split 2 / 2 unpadded, down's per-channel scales replicated."""
    path = tmp_path / "moe.gguf"
    _synthetic_moe(path, types, vocab=128)  # 2 panels: w8a8's embedding splits over 2 devices
    lm = load_model(str(path), quantization=quantization if quantization == "gguf" else None)
    prompts = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14]]
    cfg = dataclasses.replace(CFG, quantization=quantization)
    ref = ModelRunner(lm.config, lm.params, cfg)
    packed = weight_bytes(ref.params["layers_0"]["mlp"]["experts"])
    ref_logits, ref_tokens = greedy_logits(ref, prompts, steps=2)  # forward only: one compile a bucket
    # TP: the GGUF's stacks padded 2x, halved; w8a8's halved but down's scales f32[4, 256] on both
    tp_bytes = packed if quantization == "gguf" else packed // 2 + 4 * 256 * 4 // 2
    for ep in eps:
        per_device = packed // 2 if ep else tp_bytes
        runner = ModelRunner(lm.config, lm.params, dataclasses.replace(cfg, tensor_parallel_size=2,
                                                                       enable_expert_parallel=ep))
        experts = runner.params["layers_0"]["mlp"]["experts"]
        assert all(isinstance(w, weight_formats.ExpertStack) for w in experts.values())
        got = [type(experts[p].w).__name__ for p in ("gate_proj", "up_proj", "down_proj")]
        assert got == kinds, got
        assert set(ml.bytes_per_device(experts).values()) == {per_device}, ep  # stored bytes, not float32
        down = experts["down_proj"].w.q
        assert down.sharding.shard_shape(down.shape)[:2] == ((2, 4) if ep else (4, 4)), ep
        with mock.patch.object(expert_matmul, "native_grouped", wraps=expert_matmul.native_grouped) as native:
            logits, tokens = greedy_logits(runner, prompts, steps=2)
        assert native.call_count >= 2 and not runner.backend.native_linear  # native experts, XLA's dense layers
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{quantization} ep={ep}: greedy tokens differ")
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 1e-5, f"{quantization} experts ep={ep}: logits differ by {err:.2e} of their scale"


def test_ep_layout_errors(tiny_model):
    lm = load_model(tiny_model("qwen3_moe"))
    six = dataclasses.replace(lm.config, num_experts=6, expert_parallel=True)
    with pytest.raises(UserError, match=r"num_experts=6 is not divisible by 4 \(expert parallel\)"):
        sharding.check_layout(six, 4)
    odd = dataclasses.replace(lm.config, moe_intermediate_size=30)
    with pytest.raises(UserError, match=r"moe_intermediate_size=30 is not divisible by 4.*--enable-expert-parallel"):
        sharding.check_layout(odd, 4)
    sharding.check_layout(dataclasses.replace(odd, expert_parallel=True), 4)  # whole experts: fine
    dense = load_model(tiny_model("llama"))
    with pytest.raises(UserError, match="enable_expert_parallel needs a mixture-of-experts model"):
        ModelRunner(dense.config, dense.params, dataclasses.replace(CFG, enable_expert_parallel=True))
