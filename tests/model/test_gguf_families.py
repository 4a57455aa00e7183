"""GGUF files of Gemma 3 and of the Qwen MoE families, written from tiny random HF models the way
llama.cpp's convert_hf_to_gguf.py writes them (gguf's own HF -> GGUF tensor-name map, Gemma's norms
stored as w + 1, experts stacked [E, out, in], the metadata keys the converter writes and no more;
as llama.cpp's quantizer, 1-D tensors and routers stay F32), read back by jaxserve and run against
transformers' float32 forward of the weights the file holds: F32, and Q8_0 with the dense matrices
kept in their blocks (and the experts whose shape has whole blocks and panels). The config a file
stands for equals the one read from the HF directory. Also: Q4_K / Q6_K stacked experts (Q4_K_M's
mix) dequantize, or decode kept, as their per-expert matrices, and an inconsistent MoE file is
refused by name."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.errors import UserError
from jaxserve.model.gguf_loader import load_gguf
from jaxserve.model.loader import load_model
from jaxserve.runtime import kquants, weight_formats
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_hf_parity import BS, run_logits

GGUF_ARCH = {"gemma3_text": gguf.MODEL_ARCH.GEMMA3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
             "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
             "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE}
_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _metadata(w: gguf.GGUFWriter, hf: dict, arch: gguf.MODEL_ARCH) -> None:
    """The hyperparameters convert_hf_to_gguf.py writes for these architectures (Gemma3Model,
    Qwen2MoeModel / Qwen3MoeModel over TextModel)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    nextn = (hf.get("num_nextn_predict_layers") or 0) if arch == gguf.MODEL_ARCH.GLM4_MOE else 0
    w.add_block_count(hf["num_hidden_layers"] + nextn)  # GLM: its MTP layers count (none stored here)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    rope = hf["rope_parameters"]
    if arch == gguf.MODEL_ARCH.GEMMA3:  # the global layers' RoPE; the local one is llama.cpp's fixed 10k
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if hf.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        w.add_sliding_window(hf["sliding_window"])
        return
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_count(hf.get("num_experts") or hf.get("num_local_experts") or hf["n_routed_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf.get("moe_intermediate_size") or hf["intermediate_size"])  # gpt-oss: the latter
    if hf.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    if arch == gguf.MODEL_ARCH.GLM4_MOE:  # Glm4MoeModel.set_gguf_parameters
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(hf["n_shared_experts"])
        w.add_leading_dense_block_count(hf["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(hf["routed_scaling_factor"])
        w.add_expert_weights_norm(hf["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)


def write_gguf(hf_dir, out, qtype: str = "F32") -> dict[str, np.ndarray]:
    """Convert the HF model in `hf_dir` to a GGUF file at `out`, matrices as `qtype` (F32 or Q8_0).
    Returns the weights the file holds, dequantized, under their HF names (transformers' reference)."""
    hf = json.load(open(f"{hf_dir}/config.json"))
    arch, n = GGUF_ARCH[hf["model_type"]], hf["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n)  # qwen2moe's mlp_only_layers: not in its map
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, hf, arch)
    tensors, held = load_file(f"{hf_dir}/model.safetensors"), {}
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, x in tensors.items():
        if m := _EXPERT.match(name):  # experts: one [E, out, in] tensor per projection
            stacked.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = x
    merged = {k: np.stack([v[e] for e in sorted(v)]) for k, v in stacked.items()}
    for name, x in [(k, v) for k, v in tensors.items() if not _EXPERT.match(k)] + list(merged.items()):
        gname = (names.get_name(name.replace("e_score_correction_bias", "e_score_correction.bias"),
                                try_suffixes=(".weight", ".bias"))  # the converter's rename of GLM's bias
                 or dense.get_name(name, try_suffixes=(".weight",)))
        assert gname, name
        stored = x + np.float32(1.0) if arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight") else x
        if arch == gguf.MODEL_ARCH.LLAMA and re.search(r"self_attn\.[qk]_proj\.weight$", name):  # LlamaModel.permute
            assert qtype == "F32", "held would need the permutation undone"
            heads = hf["num_attention_heads"] if ".q_proj" in name else hf["num_key_value_heads"]
            stored = x.reshape(heads, 2, x.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(x.shape)
        if qtype != "F32" and x.ndim >= 2 and "ffn_gate_inp" not in gname and x.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
            writer.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType[qtype])
            x = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[qtype]).reshape(x.shape)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(stored, np.float32))
        if name in merged:
            m = re.match(r"(.*)\.(\w+)\.weight$", name)
            held |= {f"{m[1]}.{e}.{m[2]}.weight": x[e] for e in range(x.shape[0])}
        else:
            held[name] = x
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _hf_copy(hf_dir, weights: dict, out):
    """`hf_dir` with `weights` in place of its own: the reference for a quantized file."""
    out.mkdir()
    shutil.copy(f"{hf_dir}/config.json", out / "config.json")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, str(out / "model.safetensors"))
    return str(out)


def _logit_error(lm, ref_dir, quantization, decodes=4) -> float:
    """Chunked prefill of 40 tokens (24 + 16: past Gemma's 20-token window, over 16-token KV blocks),
    then decode steps: the max logit difference from transformers, relative to the logit scale."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = np.random.default_rng(1).integers(3, lm.config.vocab_size, size=40 + decodes).tolist()
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
        quantization=quantization))
    blocks, got, want = [7, 3, 11, 5], [], []
    for start, n in ((0, 24), (24, 16)) + tuple((p, 1) for p in range(40, 40 + decodes)):
        got.append(run_logits(runner, ids, start, n, blocks))
        want.append(ref[start + n - 1])
    return float(np.abs(np.stack(got) - np.stack(want)).max() / np.abs(ref).max())


def _fields(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k != "checkpoint_dtype"}


@pytest.mark.parametrize("arch,layers,qtype", [("gemma3_gguf", 6, "F32"), ("gemma3_gguf", 6, "Q8_0"),
                                               ("qwen3_moe", 2, "F32"), ("qwen3_moe", 2, "Q8_0"),
                                               ("qwen2_moe", 2, "F32"), ("mixtral", 2, "F32"),
                                               ("glm4_moe_gguf", 2, "F32")])
def test_gguf_logits_match_transformers(tiny_model, tmp_path, arch, layers, qtype):
    hf_dir = tiny_model(arch, layers=layers)
    path = tmp_path / "model.gguf"
    held = write_gguf(hf_dir, path, qtype)
    quantization = None if qtype == "F32" else "gguf"
    lm = load_model(str(path), quantization=quantization)
    assert _fields(lm.config) == _fields(load_model(hf_dir).config)  # the file stands for the HF config
    if arch == "gemma3_gguf":  # llama.cpp's pattern: five sliding layers, then a global one
        assert [lm.config.layer_window(i) for i in range(6)] == [20] * 5 + [None]
    else:  # stacked; under gguf the Q8_0 experts whose [K, N] has whole panels (N % 64) stay as stored
        experts = lm.params[f"layers_{lm.config.moe_layers[0]}"]["mlp"]["experts"]
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert experts[p].shape[0] == lm.config.num_experts
            kept = quantization == "gguf" and experts[p].shape[2] % 64 == 0
            assert isinstance(experts[p], weight_formats.ExpertStack if kept else np.ndarray), p
    if quantization:
        kept = lm.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
        assert isinstance(kept, weight_formats.Q8Weight)  # the dense matrices stay in their blocks
    ref_dir = hf_dir if qtype == "F32" else _hf_copy(hf_dir, held, tmp_path / "ref")
    err = _logit_error(lm, ref_dir, quantization)
    assert err <= 1e-4, f"{arch} {qtype}: max abs logit diff {err:.2e} relative to logit scale"


def _synthetic_moe(path, types: dict, hidden=256, inter=256, experts=4, vocab=64) -> dict:
    """A 1-layer qwen3moe file of random weights; `types`: the ggml type of the tensors whose name
    contains a key (the first key that matches; F32 otherwise). Returns {GGUF name: stored array}."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, v in (("block_count", 1), ("embedding_length", hidden), ("feed_forward_length", inter),
                   ("attention.head_count", 2), ("attention.head_count_kv", 2), ("expert_count", experts),
                   ("expert_used_count", 2), ("expert_feed_forward_length", inter)):
        w.add_uint32(f"qwen3moe.{key}", v)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,),
              "blk.0.ffn_norm.weight": (hidden,), "blk.0.attn_q_norm.weight": (128,),
              "blk.0.attn_k_norm.weight": (128,),
              "blk.0.ffn_gate_inp.weight": (experts, hidden), "blk.0.ffn_gate_exps.weight": (experts, inter, hidden),
              "blk.0.ffn_up_exps.weight": (experts, inter, hidden),
              "blk.0.ffn_down_exps.weight": (experts, hidden, inter)}
    shapes |= {f"blk.0.attn_{p}.weight": (hidden, hidden) for p in ("q", "k", "v", "output")}
    stored = {}
    for name, shape in shapes.items():
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        kind = next((t for k, t in types.items() if k in name), "F32")
        if kind == "F32":
            stored[name] = x
            w.add_tensor(name, x)
        else:
            rows = x.reshape(-1, shape[-1])
            raw = (kquants.quantize_gguf(rows, kind) if kind in kquants.FORMATS
                   else gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])).reshape(*shape[:-1], -1)
            stored[name] = raw
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_k_quant_experts_dequantized_per_expert(tmp_path):
    """Q4_K gate/up and Q6_K down experts, as Q4_K_M writes them: each expert's matrix is what
    gguf.quants.dequantize gives for that expert's rows; under keep_quantized they stay in their
    blocks (one ExpertStack per projection, under expert 0's name) and decode to the same matrices,
    as the Q4_K attention matrices do."""
    path = tmp_path / "moe.gguf"
    stored = _synthetic_moe(path, {"ffn_down_exps": "Q6_K", "_exps": "Q4_K", "attn_q.": "Q4_K"})
    cfg, floats = load_gguf(path)
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (
        "qwen3_moe", 4, 2, 256)
    assert cfg["mlp_only_layers"] == [] and cfg["norm_topk_prob"] is True  # llama.cpp's qwen3moe default
    _, kept = load_gguf(path, keep_quantized=True)
    assert isinstance(kept["model.layers.0.self_attn.q_proj.weight"], weight_formats.Q4KWeight)
    for proj, kind in (("gate_proj", "Q4_K"), ("up_proj", "Q4_K"), ("down_proj", "Q6_K")):
        raw = stored[f"blk.0.ffn_{proj[:-5]}_exps.weight"]
        for e in range(4):
            want = gguf.quants.dequantize(raw[e], gguf.GGMLQuantizationType[kind])
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            np.testing.assert_array_equal(floats[name], want, err_msg=name)
            stack = kept[f"model.layers.0.mlp.experts.0.{proj}.weight"]
            assert isinstance(stack, weight_formats.ExpertStack) and type(stack.w).__name__ == f"{kind[:2]}KWeight"
            np.testing.assert_array_equal(np.asarray(stack.expert(e)).T, want, err_msg=name)
    assert not any(".experts.1." in name for name in kept)  # the stack is one entry


def test_inconsistent_moe_file_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    _synthetic_moe(path, {}, hidden=32, inter=32, experts=3)
    data = path.read_bytes()
    key = b"qwen3moe.expert_count"
    i = data.index(key) + len(key) + 4  # the value after its u32 type
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:i] + np.uint32(4).tobytes() + data[i + 4:])
    with pytest.raises(UserError, match=r"ffn_\w+_exps.*\[4 \(expert_count\)") as e:
        load_gguf(bad)
    assert "bad.gguf" in str(e.value)


def _gemma3_header(path, layers: int, hidden: int = 64, heads: int = 4, metadata=()) -> dict:
    """A gemma3 file of metadata (and the two tensors every file has): its config dict."""
    from jaxserve.model.gguf_loader import GGUFFile, gguf_config

    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, v in (("block_count", layers), ("embedding_length", hidden), ("feed_forward_length", 2 * hidden),
                   ("attention.head_count", heads), ("attention.head_count_kv", 1), ("attention.key_length", 128)):
        w.add_uint32(f"gemma3.{key}", v)
    for key, v in metadata:
        w.add_key_value(f"gemma3.{key}", v,
                        gguf.GGUFValueType.ARRAY if isinstance(v, list) else gguf.GGUFValueType.UINT32,
                        sub_type=gguf.GGUFValueType.BOOL if isinstance(v, list) else None)
    w.add_tensor("token_embd.weight", np.zeros((8, hidden), np.float32))
    w.add_tensor("output_norm.weight", np.zeros(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_config(GGUFFile(path))


def test_gemma3_header_rules(tmp_path):
    """What llama.cpp fixes for gemma3 rather than stores: the 27B (62 layers) scales scores by
    hidden / heads (its query_pre_attn_scalar, 168), the others by head_dim; every 6th layer global;
    an explicit per-layer pattern wins; no sliding_window: every layer global."""
    big = _gemma3_header(tmp_path / "27b.gguf", 62, hidden=5376, heads=32,
                         metadata=[("attention.sliding_window", 1024)])
    assert big["query_pre_attn_scalar"] == 168 and big["sliding_window"] == 1024
    assert [i for i, t in enumerate(big["layer_types"]) if t == "full_attention"] == list(range(5, 62, 6))
    assert big["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    small = _gemma3_header(tmp_path / "1b.gguf", 4, metadata=[("attention.sliding_window", 512),
                                                              ("attention.sliding_window_pattern", [True, False] * 2)])
    assert small["query_pre_attn_scalar"] == 128
    assert small["layer_types"] == ["sliding_attention", "full_attention"] * 2
    none = _gemma3_header(tmp_path / "global.gguf", 3)
    assert none["layer_types"] == ["full_attention"] * 3 and none["sliding_window"] is None
