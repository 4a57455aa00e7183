"""GGUF gpt-oss, written from the tiny random HF gpt-oss the way llama.cpp's convert_hf_to_gguf.py
writes it (arch `gpt-oss`: gate / up experts apart and transposed to [E, out, in], their biases,
`attn_sinks.weight`, `post_attention_norm`, sliding window and YaRN metadata), with F32 experts and
with MXFP4 experts (ggml type 39, quantized by gguf's own quantizer), read back by jaxserve (MXFP4
kept packed) and run against transformers' float32 forward of the values the file holds.
llama.cpp fixes the SwiGLU clamp at 7.0 (not stored), so the reference is the HF model with that
limit. Helpers: tests/model/test_gguf_families.py."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.model.loader import load_model
from jaxserve.runtime import mxfp4
from tests.model.test_gguf_families import _fields, _logit_error, _metadata

ARCH = gguf.MODEL_ARCH.GPT_OSS
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def _gguf_tensors(tensors: dict) -> dict:
    """HF gpt-oss tensors under the names gguf's map knows, as the converter splits them: gate_up
    [E, H, 2I] (even columns gate) -> gate / up [E, I, H]; down [E, I, H] -> [E, H, I]."""
    out = {}
    for name, x in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            out[base + "gate_proj.weight"] = x[..., 0::2].swapaxes(-1, -2)
            out[base + "up_proj.weight"] = x[..., 1::2].swapaxes(-1, -2)
        elif name.endswith("experts.gate_up_proj_bias"):
            base = name[: -len("gate_up_proj_bias")]
            out[base + "gate_proj.bias"], out[base + "up_proj.bias"] = x[..., 0::2], x[..., 1::2]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = x.swapaxes(-1, -2)
        elif name.endswith("experts.down_proj_bias"):
            out[name[: -len("_bias")] + ".bias"] = x
        elif name.endswith("sinks"):
            out[name + ".weight"] = x
        else:
            out[name] = x
    return out


def write_gpt_oss_gguf(hf_dir, out, experts: str) -> dict:
    """The file at `out` (experts "F32" or "MXFP4", everything else F32); returns the HF tensors
    holding the values the file holds (MXFP4 experts dequantized by gguf), for the reference."""
    hf = json.load(open(f"{hf_dir}/config.json"))
    names = gguf.get_tensor_name_map(ARCH, hf["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[ARCH])
    _metadata(w, hf, ARCH)
    rope = hf["rope_parameters"]
    w.add_sliding_window(hf["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tensors = load_file(f"{hf_dir}/model.safetensors")
    held = dict(tensors)
    for name, x in _gguf_tensors(tensors).items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, name
        if experts == "MXFP4" and x.ndim == 3:
            q = gguf.quants.quantize(np.ascontiguousarray(x), MXFP4)
            w.add_tensor(gname, q, raw_dtype=MXFP4)
            x = gguf.quants.dequantize(q, MXFP4).reshape(x.shape)
            base, proj = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            if proj == "down_proj":
                held[base + ".down_proj"] = x.swapaxes(-1, -2)
            else:  # back into gate_up's interleaved columns
                gu = held[base + ".gate_up_proj"] = held[base + ".gate_up_proj"].copy()
                gu[..., 0 if proj == "gate_proj" else 1::2] = x.swapaxes(-1, -2)
        else:
            w.add_tensor(gname, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _reference(hf_dir, weights: dict, out) -> str:
    """`hf_dir` with `weights` and llama.cpp's fixed SwiGLU limit: what the file stands for."""
    out.mkdir()
    hf = json.load(open(f"{hf_dir}/config.json")) | {"swiglu_limit": 7.0}
    (out / "config.json").write_text(json.dumps(hf))
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, str(out / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{hf_dir}/{f}", out / f)
    return str(out)


def test_gguf_gpt_oss_f32_loads_as_its_safetensors_twin(tiny_model, tmp_path):
    """F32 experts: every parameter (experts transposed back to [E, in, out], their biases, sinks,
    router, norms) equals the HF directory's, exactly; no forward needed (the MXFP4 test runs one)."""
    import jax

    hf_dir = tiny_model("gpt_oss", layers=2)
    path = tmp_path / "model.gguf"
    ref_dir = _reference(hf_dir, write_gpt_oss_gguf(hf_dir, path, "F32"), tmp_path / "ref")
    got, want = load_model(str(path)), load_model(ref_dir)
    assert _fields(got.config)["swiglu_limit"] == 7.0 and got.config.expert_format is None
    paths = jax.tree_util.tree_flatten_with_path(got.params)[0]
    assert len(paths) == len(jax.tree.leaves(want.params))
    for (p, a), b in zip(paths, jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(p))


@pytest.mark.parametrize("experts", ["MXFP4"])
def test_gguf_gpt_oss_matches_transformers(tiny_model, tmp_path, experts):
    hf_dir = tiny_model("gpt_oss", layers=2)
    path = tmp_path / "model.gguf"
    ref_dir = _reference(hf_dir, write_gpt_oss_gguf(hf_dir, path, experts), tmp_path / "ref")
    lm = load_model(str(path))
    want = load_model(ref_dir).config
    packed = experts == "MXFP4"
    assert lm.config.expert_format == ("mxfp4" if packed else None) and lm.config.swiglu_limit == 7.0
    fields = _fields(want)
    fields["rope_scaling"].pop("rope_theta")  # HF's rope_parameters carry it; the file stores it apart
    assert _fields(lm.config) | {"expert_format": None} == fields  # the file stands for the HF config
    gate = lm.params["layers_0"]["mlp"]["experts"]["gate_proj"]
    assert isinstance(gate, mxfp4.Mxfp4Weight) == packed and gate.shape == (8, 64, 128)
    err = _logit_error(lm, ref_dir, None)
    assert err <= 1e-4, f"gpt-oss GGUF {experts}: max abs logit diff {err:.2e} relative to logit scale"


def test_ggml_mxfp4_blocks_convert_to_hf_layout():
    """gguf's MXFP4 blocks (exponent first, values 0..15 in low nibbles) -> runtime/mxfp4.py's HF layout:
    the same values, exactly, as gguf dequantizes them."""
    x = np.random.default_rng(0).normal(0, 1, (3, 5, 64)).astype(np.float32)
    q = gguf.quants.quantize(x, MXFP4)
    w = mxfp4.from_ggml(q)
    assert w.blocks.shape == (3, 5, 2, 16) and w.scales.shape == (3, 5, 2)
    np.testing.assert_array_equal(mxfp4.decode_numpy(w.blocks, w.scales), gguf.quants.dequantize(q, MXFP4))
