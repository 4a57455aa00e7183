"""The checkpoint's dtype is read from its config and picks the KV cache's default dtype: a
bfloat16 checkpoint computed in float32 keeps K/V in bfloat16; everything else stores the compute
dtype; an explicit kv_cache_dtype always wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.runtime.kv_sizing import default_kv_cache_dtype
from tests.conftest import ENGINE_KW

HF = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4)


@pytest.mark.parametrize("entry,expect", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float32"}, "float32"),
    ({"dtype": "float16"}, "float16"), ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
    ({"torch_dtype": "bf16"}, "bfloat16"), ({}, None), ({"torch_dtype": "int8"}, None)])
def test_checkpoint_dtype_from_config(entry, expect):
    assert ModelConfig.from_hf({**HF, **entry}).checkpoint_dtype == expect


@pytest.mark.parametrize("dtype,checkpoint,expect", [
    ("float32", "bfloat16", "bfloat16"), ("float32", "float32", "float32"), ("float32", "float16", "float32"),
    ("float32", None, "float32"), ("bfloat16", "bfloat16", "bfloat16"), ("bfloat16", "float32", "bfloat16"),
    ("float16", "bfloat16", "float16")])
def test_default_kv_cache_dtype(dtype, checkpoint, expect):
    assert default_kv_cache_dtype(dtype, checkpoint) == expect


def _as_bfloat16_checkpoint(src: str, dst: Path) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_engine_kv_dtype_follows_checkpoint(tiny_model, tmp_path):
    import jax.numpy as jnp

    from jaxserve import LLM, SamplingParams

    f32 = tiny_model("llama")
    bf16 = _as_bfloat16_checkpoint(f32, tmp_path / "bf16")
    cases = [(f32, {}, "float32"), (bf16, {}, "bfloat16"), (bf16, {"kv_cache_dtype": "float32"}, "float32")]
    for path, kw, expect in cases:
        llm = LLM(path, **{**ENGINE_KW, **kw})
        assert llm.engine.runner.kv_caches[0][0].dtype == jnp.dtype(expect), (path, kw)
        assert llm.engine.runner.dtype == jnp.dtype("float32")  # compute stays float32 on CPU
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def _retyped(src: str, dst: Path, dtype: str) -> str:
    """The checkpoint at `src` with its float tensors stored as `dtype` (torch: safetensors' numpy
    writer has no bfloat16); values are rounded once, so a float32 copy of the bfloat16 one holds
    the very same numbers."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: v.to(getattr(torch, dtype)) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_bfloat16_checkpoint_stays_bfloat16_on_the_host(tiny_model, tmp_path, quantization):
    """Issue 24 item 6: a bfloat16 checkpoint is held in bfloat16 on the host (no float32 copy of
    the whole model; the runner casts shard by shard) and runs exactly as its float32 copy does."""
    import ml_dtypes
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.model.loader import load_model

    bf16 = _retyped(tiny_model("llama"), tmp_path / "bf16", "bfloat16")
    f32 = _retyped(bf16, tmp_path / "f32", "float32")
    leaves = [w for layer in load_model(bf16).params.values() for w in _arrays(layer)]
    assert leaves and all(w.dtype == ml_dtypes.bfloat16 for w in leaves)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    outs = []
    for path in (bf16, f32):
        llm = LLM(path, **{**ENGINE_KW, "quantization": quantization})
        out = llm.generate([[5, 6, 7], [9, 3]], params, use_tqdm=False)
        outs.append([(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in out])
    assert outs[0] == outs[1]
    assert np.asarray(outs[0][0][0]).size == 6


def _arrays(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _arrays(v)
    else:
        yield node
