"""gpt-oss presets (configs/models): parameter counts against the published sizes, and the memory
plan on one H200 with the experts kept in MXFP4 as the checkpoints ship them (test_lower.py lowers
each preset's one-layer cut for cuda and tpu)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketKey
from jaxserve.runtime import mxfp4
from jaxserve.worker.lower import AbstractCheckpoint, load_model_config, prepare

MODELS = Path(__file__).parents[1] / "configs" / "models"
GiB = 1 << 30


def _count(tree) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))


@pytest.mark.parametrize("preset,billions", [("gpt-oss-20b", 20.9), ("gpt-oss-120b", 116.8)])
def test_gpt_oss_presets_are_the_models_they_name(preset, billions):
    mc = load_model_config(str(MODELS / f"{preset}.json"))
    assert mc.expert_format == "mxfp4" and mc.attention_sinks and mc.layer_window(0) == 128
    assert mc.layer_window(1) is None and mc.rope_theta == 150000 and mc.rope_scaling["factor"] == 32.0
    assert mc.rope_attention_factors()[0] == pytest.approx(0.1 * math.log(32) + 1)
    one = AbstractCheckpoint(dataclasses.replace(mc, num_layers=1)).shapes()
    layer = _count(one.pop("layers_0"))
    got = (_count(one) + mc.num_layers * layer) / 1e9
    assert abs(got - billions) / billions < 0.02, (preset, got, billions)


def test_gpt_oss_120b_fits_one_h200_in_mxfp4():
    """60.8 GiB of weights (the published checkpoint's size: experts at 4.25 bits, the rest in
    bfloat16) on a 141 GiB H200, with room for the full 131072-token context several times over;
    the plan names the format and the Pallas attention backend (it takes the sinks)."""
    lowering = prepare(str(MODELS / "gpt-oss-120b.json"), "cuda", EngineConfig(max_model_len=131072),
                       device_memory=141 * GiB)
    assert 60 * GiB < lowering.total_weight_bytes < 61.5 * GiB
    experts = lowering.runner.params["layers_0"]["mlp"]["experts"]["down_proj"]
    assert isinstance(experts, mxfp4.Mxfp4Weight) and experts.blocks.shape == (128, 2880, 90, 16)
    assert lowering.plan.num_blocks * 16 >= 4 * 131072
    text = "\n".join(lowering.describe())
    assert "experts in MXFP4" in text and "attention=pallas" in text


@pytest.mark.parametrize("ep", [False, True])
def test_gpt_oss_120b_plans_at_tp8_with_mxfp4_experts(ep):
    """TP 8 splits each expert's intermediate axis: 2880 = 90 MXFP4 blocks do not split 8 ways, so
    it is padded to 3072 (384 per device, whole blocks; zero rows and blocks); EP 8 keeps 16 whole
    experts per device, unpadded. Blocks and scales shard alike, the plan fits one H200 each, and a
one-layer cut's step lowers for cuda on 8 devices."""
    lowering = prepare(str(MODELS / "gpt-oss-120b.json"), "cuda",
                       EngineConfig(max_model_len=131072, tensor_parallel_size=8, enable_expert_parallel=ep),
                       device_memory=141 * GiB)
    experts = lowering.runner.params["layers_0"]["mlp"]["experts"]
    gate, down = experts["gate_proj"], experts["down_proj"]

    def shard(a):
        return a.sharding.shard_shape(a.shape)

    if ep:
        assert gate.blocks.shape == (128, 2880, 90, 16) and shard(gate.blocks) == (16, 2880, 90, 16)
        assert shard(down.scales) == (16, 2880, 90) and shard(experts["gate_bias"]) == (16, 2880)
    else:
        assert shard(gate.blocks) == (128, 384, 90, 16) and shard(gate.scales) == (128, 384, 90)
        assert shard(down.blocks) == (128, 2880, 12, 16) and shard(down.scales) == (128, 2880, 12)
        assert shard(experts["up_bias"]) == (128, 384) and lowering.runner.model_cfg.moe_intermediate_size == 3072
    text = "\n".join(lowering.describe())
    assert "experts in MXFP4" in text and "tensor parallel 8" in text
    assert ("padded to 3072" in text) != ep, text
    assert lowering.plan.num_blocks * 16 >= 131072
    cut = prepare(str(MODELS / "gpt-oss-120b.json"), "cuda", EngineConfig(
        max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=16, tensor_parallel_size=8,
        enable_expert_parallel=ep), device_memory=141 * GiB, num_layers=1)
    step = cut.lower(BucketKey(16, 8, 0))  # one layer's step exports with the packed experts under shard_map
    assert step.num_devices == 8 and step.kernel_calls == 1, step.describe()
