"""What a GGUF file's metadata and tensor names mean for each llama.cpp architecture: the HF-style
config.json dict they stand for (`gguf_config`) and the HF name of each tensor (`hf_tensor_name`).

Read as llama.cpp's convert_hf_to_gguf.py writes them and llama.cpp reads them back:
- llama / mistral: q/k rows permuted for interleaved RoPE (undone by the loader, `PERMUTED_QK`).
- qwen2 / qwen3: written as in HF.
- gemma3: every `*norm.weight` stored as w + 1 (Gemma's RMSNorm scales by 1 + w; the loader
  subtracts the 1 again, `NORM_SHIFT`), `ffn_norm` is the pre-feedforward norm and
  `post_attention_norm` / `post_ffw_norm` the post norms. What llama.cpp does not store it fixes,
  and so is it read here: every 6th layer global, the others sliding (`attention.sliding_window`;
  an explicit `attention.sliding_window_pattern` wins), the local layers' RoPE base 10000 unscaled
  (`rope.freq_base_swa` wins), `rope.scaling.*` applies to the global layers, and scores scaled by
  head_dim^-1/2 except on the 62-layer 27B (hidden / heads, as its query_pre_attn_scalar 168).
- qwen3moe / qwen2moe: routed experts stacked [E, out, in] per projection (`ffn_*_exps`), the
  router `ffn_gate_inp`; qwen2moe's shared expert `ffn_*_shexp` with its gate `ffn_gate_inp_shexp`.
  A layer without a router is a dense layer (Qwen's mlp_only_layers). top-k renormalisation is
  `expert_weights_norm` where written, else llama.cpp's fixed choice (qwen3moe yes, qwen2moe no).
- llama with `expert_count` (Mixtral, as llama.cpp writes it: arch llama, q/k permuted): the router
  `ffn_gate_inp` and stacked `ffn_{gate,up,down}_exps` are Mixtral's block_sparse_moe gate and
  experts' w1 / w3 / w2; `feed_forward_length` is the expert size.
- glm4moe (GLM-4.5 / -Air): `post_attention_norm` the pre-MLP norm, sigmoid router `ffn_gate_inp`
  with its correction bias `exp_probs_b.bias`, shared experts `ffn_*_shexp`, the first
  `leading_dense_block_count` layers dense, partial RoPE from `rope.dimension_count`; the
  `nextn_predict_layers` multi-token-prediction layers past the decoder are not loaded. llama.cpp
  stores no expert groups (its GLM-4.5 routing takes the top k of all experts): n_group 1.
- gpt-oss: q/k/v/o biases, `attn_sinks`, `post_attention_norm` the pre-MoE norm, a biased router
  `ffn_gate_inp`, experts stacked whole (`ffn_{gate,up,down}_exps` [E, out, in] with their biases
  [E, out]; gate and up already apart) in MXFP4 (ggml type 39: kept packed, the loader converts the
  block layout) or a float / other type (dequantized). What llama.cpp fixes it does not store: the
  SwiGLU clamp 7.0 and alpha 1.702, layers alternating sliding / full from layer 0, and YaRN without
  truncation (gpt-oss's `truncate: false`; beta 32 / 1 unless written).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.errors import UserError

# llama.cpp architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),  # Mistral is Llama-shaped; llama.cpp also calls it llama
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
}
PERMUTED_QK = {"llama", "mistral"}  # q/k rows stored permuted (convert_hf_to_gguf.py LlamaModel.permute)
NORM_SHIFT = {"gemma3"}  # norm weights stored as w + 1
MOE = {"qwen3moe", "qwen2moe"}
EXPERT = "{expert}"  # the expert index's place in a stacked tensor's HF name
WHOLE_EXPERTS = {"gpt-oss"}  # stacked experts kept as one [E, in, out] tensor (or MXFP4) under one HF name
GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp: ggml_swiglu_oai's fixed limit, not stored in the file

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_TENSORS = _LAYER_TENSORS | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_MOE_TENSORS = _LAYER_TENSORS | {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": f"mlp.experts.{EXPERT}.gate_proj.weight",
    "ffn_up_exps.weight": f"mlp.experts.{EXPERT}.up_proj.weight",
    "ffn_down_exps.weight": f"mlp.experts.{EXPERT}.down_proj.weight",
}
_QWEN2MOE_TENSORS = _MOE_TENSORS | {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_GPT_OSS_TENSORS = {k: v for k, v in _LAYER_TENSORS.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
} | {f"ffn_{p}_exps.{kind}": f"mlp.experts.{p}_{'proj' if kind == 'weight' else 'bias'}"
     for p in ("gate", "up", "down") for kind in ("weight", "bias")}
_MIXTRAL_TENSORS = _LAYER_TENSORS | {  # arch llama with experts
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": f"block_sparse_moe.experts.{EXPERT}.w1.weight",
    "ffn_up_exps.weight": f"block_sparse_moe.experts.{EXPERT}.w3.weight",
    "ffn_down_exps.weight": f"block_sparse_moe.experts.{EXPERT}.w2.weight",
}
_GLM4MOE_TENSORS = {k: v for k, v in _MOE_TENSORS.items() if k != "ffn_norm.weight"} | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_TENSORS_BY_ARCH = {"gemma3": _GEMMA3_TENSORS, "qwen3moe": _MOE_TENSORS, "qwen2moe": _QWEN2MOE_TENSORS,
                    "gpt-oss": _GPT_OSS_TENSORS, "llama": _MIXTRAL_TENSORS, "mistral": _MIXTRAL_TENSORS,
                    "glm4moe": _GLM4MOE_TENSORS}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp: set_swa_pattern(6), not stored in the file
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa, not stored in the file


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name for a GGUF tensor name; None for tensors folded into the config (rope_freqs). A
    stacked expert tensor's name has EXPERT where the expert index goes. KeyError: not known."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight" or ".nextn." in gguf_name:  # GLM's MTP layers: not loaded
        return None
    table = _TENSORS_BY_ARCH.get(arch, _LAYER_TENSORS)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}"
    raise KeyError(gguf_name)


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's `rope_freqs` factors, if it matches."""
    factor = float(freqs.max())
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        lo_w, hi_w = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        want = np.where(wavelen < hi_w, 1.0,
                        np.where(wavelen > lo_w, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    return None


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(f"{float(x):.7g}")


def checkpoint_dtype(g) -> str:
    """The float dtype the file's weights stand for, read from the first attention weight: F32 (or
    F64) -> float32, F16 -> float16; BF16 and every quantized type -> bfloat16 (quantized weights
    carry fewer bits than bfloat16; the models behind them are bfloat16 checkpoints)."""
    info = g.tensors.get("blk.0.attn_q.weight")
    name = info.type_name if info else "F32"
    return {"F32": "float32", "F64": "float32", "F16": "float16"}.get(name, "bfloat16")


def gguf_config(g) -> dict:
    """HF-style config.json dict from a parsed GGUF file's metadata (gguf_loader.GGUFFile)."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{g.path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    model_type, hf_arch = ARCHITECTURES[arch]

    def get(key, default=None):
        return md.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_head)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    head_dim = int(get("attention.key_length", hidden // n_head))
    tokens = md.get("tokenizer.ggml.tokens")
    embd = g.tensors.get("token_embd.weight")
    vocab = get("vocab_size") or (len(tokens) if tokens else None) or (embd.shape[0] if embd else None)
    theta = _f32(get("rope.freq_base", 10000.0))
    ffn = g.tensors.get("blk.0.ffn_gate.weight")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or (ffn.shape[0] if ffn else 0)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": checkpoint_dtype(g),
    }
    if model_type == "llama":
        cfg["mlp_bias"] = False
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in md:
            cfg[hf_key] = int(md[f"tokenizer.ggml.{key}"])
    if get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))

    rope_scaling = None
    stype = get("rope.scaling.type")
    sfactor = get("rope.scaling.factor")
    if stype in ("linear", "yarn") and sfactor and float(sfactor) != 1.0:
        rope_scaling = {"rope_type": stype, "factor": _f32(sfactor)}
        orig = get("rope.scaling.original_context_length")
        if stype == "yarn" and orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif stype not in (None, "none", "linear", "yarn"):
        raise UserError(f"{g.path}: unsupported rope scaling type {stype!r}")
    if "rope_freqs.weight" in g.tensors:
        freqs = g.dequantize("rope_freqs.weight").astype(np.float64)
        if not np.allclose(freqs, 1.0):
            rope_scaling = _llama3_rope_scaling(freqs, head_dim, theta)
            if rope_scaling is None:
                raise UserError(f"{g.path}: rope_freqs.weight does not match a llama3 rope scaling")
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if arch == "gemma3":
        cfg |= _gemma3_config(get, cfg)
    elif arch in MOE:
        cfg |= _moe_config(g, get, cfg, arch)
    elif arch == "gpt-oss":
        cfg |= _gpt_oss_config(g, get, cfg)
    elif arch == "glm4moe":
        cfg |= _glm4moe_config(g, get, cfg)
    elif get("expert_count"):  # llama / mistral with experts: Mixtral
        cfg.pop("mlp_bias", None)
        cfg |= dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count") or 2))
    return cfg


def _glm4moe_config(g, get, cfg: dict) -> dict:
    """GLM-4.5's experts, dense lead layers, partial RoPE and decoder depth (see the module docstring)."""
    if get("expert_gating_func") not in (None, 2):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise UserError(f"{g.path}: glm4moe.expert_gating_func={get('expert_gating_func')} is not sigmoid (2), the "
                        "only routing GLM-4.5 has: the file is inconsistent.", param="model")
    rot = get("rope.dimension_count")
    return dict(num_hidden_layers=cfg["num_hidden_layers"] - int(get("nextn_predict_layers") or 0),
                n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                moe_intermediate_size=int(get("expert_feed_forward_length")),
                n_shared_experts=int(get("expert_shared_count") or 0),
                first_k_dense_replace=int(get("leading_dense_block_count") or 0),
                routed_scaling_factor=_f32(get("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(get("expert_weights_norm", True)), n_group=1, topk_group=1,
                partial_rotary_factor=int(rot) / cfg["head_dim"] if rot else 0.5,
                use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors)


MXFP4_TYPE = 39  # ggml's GGML_TYPE_MXFP4


def _gpt_oss_config(g, get, cfg: dict) -> dict:
    """gpt-oss's experts and the choices llama.cpp fixes (see the module docstring)."""
    if not get("expert_count") or not get("expert_used_count"):
        raise UserError(f"{g.path}: a gpt-oss GGUF file without gpt-oss.expert_count / gpt-oss.expert_used_count "
                        "metadata: re-convert it with llama.cpp's convert_hf_to_gguf.py.", param="model")
    gate = g.tensors.get("blk.0.ffn_gate_exps.weight")
    out = dict(num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
               intermediate_size=int(get("expert_feed_forward_length") or (gate.shape[1] if gate else 0)),
               swiglu_limit=GPT_OSS_SWIGLU_LIMIT, sliding_window=cfg.get("sliding_window") or 128)
    if rope := cfg.get("rope_scaling"):
        out["rope_scaling"] = rope | dict(beta_fast=_f32(get("rope.scaling.yarn_beta_fast", 32.0)),
                                          beta_slow=_f32(get("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
    if gate is not None and gate.ggml_type == MXFP4_TYPE:  # kept packed: model/families/gpt_oss.py's expert_format
        out["quantization_config"] = {"quant_method": "mxfp4"}
    return out


def _gemma3_config(get, cfg: dict) -> dict:
    """Gemma 3's per-layer pattern, its two RoPEs and its score scale (see the module docstring)."""
    n = cfg["num_hidden_layers"]
    window = cfg.pop("sliding_window", None)
    pattern = get("attention.sliding_window_pattern")
    if not window:
        types = ["full_attention"] * n
    elif isinstance(pattern, list):  # one flag per layer, true = sliding
        types = ["sliding_attention" if p else "full_attention" for p in pattern[:n]]
    else:
        every = int(pattern or GEMMA3_GLOBAL_EVERY)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    full = {"rope_type": "default"} | (cfg.pop("rope_scaling", None) or {}) | {"rope_theta": cfg["rope_theta"]}
    local = {"rope_type": "default", "rope_theta": _f32(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))}
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    out = dict(layer_types=types, sliding_window=window, rope_parameters={"full_attention": full,
                                                                          "sliding_attention": local},
               query_pre_attn_scalar=scalar, hidden_act="gelu_pytorch_tanh")
    if get("final_logit_softcapping"):
        out["final_logit_softcapping"] = _f32(get("final_logit_softcapping"))
    return out


def _moe_config(g, get, cfg: dict, arch: str) -> dict:
    """The experts' count, top-k, sizes and which layers are sparse, from metadata (shapes where a
    size is not written)."""
    n = cfg["num_hidden_layers"]
    sparse = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in g.tensors]
    if not get("expert_count") or not get("expert_used_count"):
        raise UserError(f"{g.path}: a {arch} GGUF file without {arch}.expert_count / {arch}.expert_used_count "
                        "metadata: re-convert it with llama.cpp's convert_hf_to_gguf.py.", param="model")
    stacked = g.tensors.get(f"blk.{sparse[0]}.ffn_gate_exps.weight") if sparse else None
    out = dict(
        num_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length") or (stacked.shape[1] if stacked else 0)),
        mlp_only_layers=[i for i in range(n) if i not in sparse],
        norm_topk_prob=bool(get("expert_weights_norm", arch == "qwen3moe")),
    )
    if not cfg["intermediate_size"]:
        cfg["intermediate_size"] = out["moe_intermediate_size"]  # every layer sparse: not used
    if arch == "qwen2moe":
        shared = g.tensors.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight") if sparse else None
        size = get("expert_shared_feed_forward_length") or (shared.shape[0] if shared else 0)
        out |= dict(shared_expert_intermediate_size=int(size), qkv_bias=cfg["attention_bias"])
    return out
