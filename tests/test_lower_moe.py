"""Mixture-of-experts presets (configs/models): parameter counts against the published sizes, the
memory plan counting every expert (split over devices under expert parallelism), and the step
lowering for cuda and tpu with experts sharded 8 ways (test_lower.py lowers every preset's one-layer
cut at TP 1)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketKey
from jaxserve.errors import UserError
from jaxserve.worker.lower import AbstractCheckpoint, load_model_config, prepare
from tests.test_lower import _one_layer

MODELS = Path(__file__).parents[1] / "configs" / "models"
GiB = 1 << 30


def _count(tree) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))


@pytest.mark.parametrize("preset,billions", [
    ("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1), ("mixtral-8x7b", 46.7), ("qwen1.5-moe-a2.7b", 14.3),
    ("qwen2-57b-a14b", 57.4), ("glm-4.5-air", 106.0),  # GLM: without its MTP layer (not loaded either)
])
def test_moe_presets_are_the_models_they_name(preset, billions):
    mc = load_model_config(str(MODELS / f"{preset}.json"))
    assert mc.is_moe
    two = AbstractCheckpoint(dataclasses.replace(mc, num_layers=2, moe_layers=(1,))).shapes()  # a dense + a MoE layer
    dense, moe = _count(two.pop("layers_0")), _count(two.pop("layers_1"))
    n_moe = len(mc.moe_layers)
    got = (_count(two) + n_moe * moe + (mc.num_layers - n_moe) * dense) / 1e9
    assert abs(got - billions) / billions < 0.02, (preset, got, billions)


def test_memory_plan_counts_the_experts():
    """Qwen3-30B-A3B in bfloat16: ~61 GB of weights, nearly all experts. One 16 GiB TPU v5e chip
    cannot hold it (a clear error); eight with expert parallelism hold 1/8 of the experts each."""
    model = str(MODELS / "qwen3-30b-a3b.json")
    engine = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=4096)
    with pytest.raises(UserError, match="out of device memory"):
        prepare(model, "tpu", EngineConfig(**engine), device_memory=16 * GiB)
    lowering = prepare(model, "tpu", EngineConfig(**engine, tensor_parallel_size=8, enable_expert_parallel=True),
                       device_memory=16 * GiB)
    assert 60e9 < lowering.total_weight_bytes < 62e9
    experts = lowering.runner.params["layers_0"]["mlp"]["experts"]["down_proj"]
    assert experts.sharding.shard_shape(experts.shape) == (128 // 8, 768, 2048)
    assert lowering.total_weight_bytes / 8 < lowering.plan.weight_bytes < lowering.total_weight_bytes / 7
    assert lowering.plan.num_blocks * 16 >= 4096
    assert any("48 MoE layers of 128 experts, top 8 (whole experts" in line for line in lowering.describe())


@pytest.mark.parametrize("platform,ep", [("cuda", True), ("tpu", True), ("cuda", False)])
def test_qwen3_235b_lowers_at_8_devices(tmp_path, platform, ep):
    lowering = prepare(_one_layer(tmp_path, "qwen3-235b-a22b"), platform,
                       EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=4096,
                                    tensor_parallel_size=8, enable_expert_parallel=ep))
    step = lowering.lower(BucketKey(16, 8, 0))
    assert step.num_devices == 8 and step.kernel_calls >= 1, step.describe()
    text = lowering.export(BucketKey(16, 8, 0)).mlir_module()
    assert "ragged_dot" in text  # the grouped matmul, not a dense loop over experts
    # the platform's Pallas grouped matmul under shard_map (EP: whole experts; TP: slices of I), not
    # XLA's ragged_dot_general (a dense product over every expert on XLA:GPU)
    assert {"cuda": "gmm_gpu", "tpu": "gmm_tpu"}[platform] in text and "ragged_dot_general" not in text


def test_packed_experts_lower_and_plan_as_stored_under_tp_and_ep(tmp_path):
    """--quantization q4_k at TP 2: the experts stay Q4_K stacks (model/sharding.py), and the plan's
    weights per device count them as stored: whole experts under EP (half the stacks' bytes), under
    TP each expert's I = 768 padded to 1024 (2 x 512: whole 256-value super-blocks of down's K per
    device) and halved; the TP step (each device's padded slice under shard_map) lowers for cuda."""
    from jaxserve.runtime import weight_formats
    from jaxserve.runtime.quant_params import weight_bytes

    model = _one_layer(tmp_path, "qwen3-30b-a3b")
    per_device = {}
    for ep in (True, False):
        lowering = prepare(model, "cuda", EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=4096,
                                                       tensor_parallel_size=2, enable_expert_parallel=ep,
                                                       quantization="q4_k"), device_memory=141 * GiB)
        experts = lowering.runner.params["layers_0"]["mlp"]["experts"]
        assert all(isinstance(w, weight_formats.ExpertStack) and type(w.w).__name__ == "Q4KWeight"
                   for w in experts.values())
        assert experts["down_proj"].shape == (128, 768 if ep else 1024, 2048)
        per_device[ep] = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                             for a in jax.tree.leaves(experts))
        assert per_device[ep] == weight_bytes(experts) // 2
    stored = 128 * 3 * 2048 * 768 * 4.625 / 8  # Q4_K as held: 4.625 bits a weight
    assert per_device[True] == stored / 2 and per_device[False] == stored / 2 * 1024 / 768
    assert per_device[False] < 128 * 3 * 2048 * 768 * 2 / 2 / 2  # < half of the bfloat16 experts TP 2 held before
    # the plan says so (the last lowering: TP 2, not EP)
    assert "intermediate 768 padded to 1024 for whole panels / blocks" in "\n".join(lowering.describe())
    step = lowering.lower(BucketKey(16, 8, 0))
    assert step.num_devices == 2, step.describe()
