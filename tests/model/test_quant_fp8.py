"""FP8 and int8 checkpoints (float8_e4m3fn weights with per-channel scales, compressed-tensors
style, or 2-D block scales, HF's fp8 layout; int8 weights with per-channel scales) load as the float
weights they stand for, and run quantized."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.model.loader import load_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8(src, dst, layout: str) -> None:
    """`src` (a float HF dir) as an fp8 checkpoint in `dst`, and its exact float values in dst/ref."""
    fp8, ref = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not any(f".{p}.weight" in name for p in LINEAR):
            fp8[name], ref[name] = torch.from_numpy(w), w
            continue
        if layout in ("channel", "int8"):
            scale = (np.abs(w).max(axis=1, keepdims=True) / (127 if layout == "int8" else 448)).astype(np.float32)
            full = scale
        else:  # one scale per 128 x 128 block
            n, k = w.shape
            scale = np.stack([[np.abs(w[i:i + 128, j:j + 128]).max() / 448 for j in range(0, k, 128)]
                              for i in range(0, n, 128)]).astype(np.float32)
            full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
        q = (torch.from_numpy(np.rint(w / full)).to(torch.int8) if layout == "int8"
             else torch.from_numpy(w / full).to(torch.float8_e4m3fn))
        fp8[name] = q
        fp8[name + ("_scale_inv" if layout == "block" else "_scale")] = torch.from_numpy(scale)
        ref[name] = q.float().numpy() * full
    for d in (dst, dst / "ref"):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]} if layout == "block" else {
        "quant_method": "compressed-tensors", "format": "float-quantized"}
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(fp8, dst / "model.safetensors", metadata={"format": "pt"})
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ref.items()}, dst / "ref" / "model.safetensors",
              metadata={"format": "pt"})


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        yield from _leaves(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)]


@pytest.mark.parametrize("layout", ["channel", "block", "int8"])  # fp8 per channel, fp8 blocks, int8
def test_fp8_checkpoint_loads_as_its_float_values_and_runs(tiny_model, tmp_path, layout):
    from pathlib import Path

    src = Path(tiny_model("llama", hidden=128, heads=4, kv_heads=2))
    write_fp8(src, tmp_path / "fp8", layout)
    got, want = load_model(str(tmp_path / "fp8")).params, load_model(str(tmp_path / "fp8" / "ref")).params
    a, b = dict(_leaves(got)), dict(_leaves(want))
    assert sorted(a) == sorted(b)
    for path, value in a.items():
        np.testing.assert_array_equal(value, b[path], err_msg="/".join(path))
    llm = LLM(str(tmp_path / "fp8"), quantization="int8", precompile=False, max_model_len=64, num_blocks=16,
              use_tqdm=False)
    assert len(llm.generate(["hello"], use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_fp8_checkpoint_kept_as_stored(tiny_model, tmp_path):
    """quantization='fp8' on an fp8 checkpoint with per-channel scales keeps its bits and scales."""
    from pathlib import Path

    from jaxserve.runtime import weight_formats

    src = Path(tiny_model("llama", hidden=128, heads=4, kv_heads=2))
    write_fp8(src, tmp_path / "fp8", "channel")
    kept = load_model(str(tmp_path / "fp8"), quantization="fp8").params
    floats = load_model(str(tmp_path / "fp8")).params
    w = kept["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(w, weight_formats.Fp8Weight)
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(w)),
                                  floats["layers_0"]["mlp"]["up_proj"]["kernel"])
    llm = LLM(str(tmp_path / "fp8"), quantization="fp8", precompile=False, max_model_len=64, num_blocks=16,
              use_tqdm=False)
    same = LLM(str(tmp_path / "fp8" / "ref"), precompile=False, max_model_len=64, num_blocks=16, use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert (llm.generate(["hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == same.generate(["hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("qc,named", [({"quant_method": "awq", "bits": 4}, "'awq'"),
                                      ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
                                      ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
                                       "'compressed-tensors' (pack-quantized)")])
def test_unsupported_checkpoint_quantization_is_named(tiny_model, tmp_path, qc, named):
    """AWQ / GPTQ / packed int4 checkpoints: one UserError naming the method, before any weight is read."""
    from jaxserve.errors import UserError

    dst = tmp_path / "q"
    shutil.copytree(tiny_model("llama"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(UserError, match=re.escape(f"holds {named}-quantized weights")) as e:
        load_model(str(dst))
    assert e.value.param == "model"

