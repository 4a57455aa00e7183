"""Gemma 3 presets (configs/models): parameter counts against the published text-model sizes, and a
two-layer cut (one sliding-window layer, one global) lowered whole for cuda and tpu: the two
layers' attention (two windows, two RoPE kinds, head_dim 256) in one step."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketKey
from jaxserve.worker.lower import AbstractCheckpoint, load_model_config, prepare
from tests.test_lower import CALLS_PER_LAYER

MODELS = Path(__file__).parents[1] / "configs" / "models"


@pytest.mark.parametrize("preset,billions", [
    ("gemma-3-1b", 1.00), ("gemma-3-4b", 3.88), ("gemma-3-12b", 11.77), ("gemma-3-27b", 27.01),
])  # text models (the multimodal checkpoints' sizes less their ~0.42B vision tower)
def test_gemma3_presets_are_the_models_they_name(preset, billions):
    mc = load_model_config(str(MODELS / f"{preset}.json"))
    assert sum(mc.layer_window(i) is None for i in range(mc.num_layers)) == mc.num_layers // 6
    one = AbstractCheckpoint(dataclasses.replace(mc, num_layers=1)).shapes()
    layer = one.pop("layers_0")
    count = lambda t: sum(math.prod(s) for s in jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, tuple)))  # noqa: E731
    got = (count(one) + mc.num_layers * count(layer)) / 1e9
    assert abs(got - billions) / billions < 0.01, (preset, got, billions)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gemma3_sliding_and_global_layers_lower(tmp_path, platform):
    hf = json.loads((MODELS / "gemma-3-1b.json").read_text())
    hf |= {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    lowering = prepare(str(tmp_path), platform, EngineConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                                             max_model_len=4096))
    assert lowering.runner.model_cfg.rope_inv_freq().shape == (2, 128)
    step = lowering.lower(BucketKey(16, 8, 0))
    assert (step.kernel_calls, step.num_devices) == (2 * CALLS_PER_LAYER[platform], 1), step.describe()
