"""Map HF-named weights (from safetensors or the GGUF loader) onto the Flax parameter tree.

The names every family shares (embedding, norms, attention, LM head) are mapped here; each family
module maps its MLP's (model/families/). Per-expert tensors are stacked into one [E, ...] array.
"""

from __future__ import annotations

import re

import numpy as np

from jaxserve.errors import UserError
from jaxserve.model import families
from jaxserve.model.config import ModelConfig
from jaxserve.runtime.weight_formats import is_quantized

_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_LAYER_NORM = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm"
                         r"|post_feedforward_layernorm)\.weight$")
_QK_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")


def param_path(name: str, model_type: str = "llama") -> tuple[str, ...] | None:
    """HF tensor name -> (path in the Flax tree). None for tensors the model does not use."""
    found = expert_param_path(name, model_type)
    return None if found is None else found[0]


def expert_param_path(name: str, model_type: str = "llama") -> tuple[tuple[str, ...], int | None] | None:
    """HF tensor name -> (path in the Flax tree, expert index or None); None for tensors not used."""
    family = families.family(model_type)
    if family is not None and hasattr(family, "canonical_name") and (name := family.canonical_name(name)) is None:
        return None
    if (path := _common_path(name)) is not None:
        return path, None
    return None if family is None else family.param_path(name)


def _common_path(name: str) -> tuple[str, ...] | None:
    if name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding")
    if name == "model.norm.weight":
        return ("norm", "weight")
    if name == "lm_head.weight":
        return ("lm_head", "kernel")
    if m := _QK_NORM.match(name):
        return (f"layers_{m[1]}", "self_attn", m[2], "weight")
    if m := _LAYER_NORM.match(name):
        return (f"layers_{m[1]}", m[2], "weight")
    if m := _ATTN.match(name):
        return (f"layers_{m[1]}", "self_attn", m[2], "kernel" if m[3] == "weight" else "bias")
    return None  # e.g. rotary_emb.inv_freq in old checkpoints


def hf_to_params(hf_weights, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Build the nested param dict (numpy, on host) in `dtype` (None: each tensor's own, and a linear
    weight stays a view of the checkpoint's tensor). Linear weights go from [out, in] to [in, out];
    quantized ones (runtime/weight_formats.py) come in their kernel layout and are kept as they are."""
    params: dict = {}
    experts: dict = {}  # path -> {expert index: [in, out] matrix}
    family = families.family(cfg.model_type)
    if hasattr(family, "transform_weights"):  # tensors the family splits or re-packs (gpt-oss's experts)
        hf_weights = family.transform_weights(hf_weights)
    for name, w in hf_weights.items():
        found = expert_param_path(name, cfg.model_type)
        if found is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        path, expert = found
        if path[0].startswith("layers_") and int(path[0][7:]) >= cfg.num_layers:
            continue  # a multi-token-prediction layer past the decoder (GLM-4.5, DeepSeek-V3): unused
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if is_quantized(w):  # already in its kernel layout (a GGUF's blocks, runtime/weight_formats.py)
            node[path[-1]] = w
            continue
        w = np.asarray(w)
        if expert is not None:
            experts.setdefault(path, {})[expert] = w.T
            continue
        w = w.T if path[-1] == "kernel" else w
        # dtype None: the view as it is. Placement copies it once as it lays each shard out on the
        # devices, and a weight format packs it straight into its panels: a contiguous copy here
        # would be a second copy of the model while the first is still held.
        node[path[-1]] = w if dtype is None else np.ascontiguousarray(w, dtype=dtype)
    for path, by_index in experts.items():
        if sorted(by_index) != list(range(cfg.num_experts)):
            missing = sorted(set(range(cfg.num_experts)) - set(by_index))
            raise UserError(f"The checkpoint's {'/'.join(path)} lacks experts {missing[:8]} of {cfg.num_experts} "
                            "(config.json num_experts): the checkpoint is incomplete.", param="model")
        node = params
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = np.ascontiguousarray(np.stack([by_index[e] for e in range(cfg.num_experts)]), dtype=dtype)
    _check_complete(params, cfg)
    return params


def expected_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    paths = [("embed_tokens", "embedding"), ("norm", "weight")]
    if not cfg.tie_word_embeddings:
        paths.append(("lm_head", "kernel"))
    for i in range(cfg.num_layers):
        l = f"layers_{i}"
        paths += [(l, "input_layernorm", "weight"), (l, "post_attention_layernorm", "weight")]
        if cfg.gemma_norms:
            paths += [(l, "pre_feedforward_layernorm", "weight"), (l, "post_feedforward_layernorm", "weight")]
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            paths.append((l, "self_attn", p, "kernel"))
        if cfg.attention_bias:
            paths += [(l, "self_attn", p, "bias") for p in ("q_proj", "k_proj", "v_proj")]
        if cfg.o_proj_bias:
            paths.append((l, "self_attn", "o_proj", "bias"))
        if cfg.attention_sinks:
            paths.append((l, "self_attn", "sinks"))
        if cfg.qk_norm:
            paths += [(l, "self_attn", "q_norm", "weight"), (l, "self_attn", "k_norm", "weight")]
        paths += mlp_paths(cfg, i)
    return paths


def mlp_paths(cfg: ModelConfig, i: int) -> list[tuple[str, ...]]:
    l = f"layers_{i}"
    if not cfg.is_moe_layer(i):
        return [(l, "mlp", p, "kernel") for p in ("gate_proj", "up_proj", "down_proj")]
    paths = [(l, "mlp", "gate", "kernel")] + [(l, "mlp", "experts", p) for p in ("gate_proj", "up_proj", "down_proj")]
    if cfg.router == "sigmoid":
        paths.append((l, "mlp", "e_score_correction_bias"))
    if cfg.router_bias:
        paths.append((l, "mlp", "gate", "bias"))
    if cfg.expert_bias:
        paths += [(l, "mlp", "experts", p) for p in ("gate_bias", "up_bias", "down_bias")]
    if cfg.shared_expert_intermediate_size:
        paths += [(l, "mlp", "shared_expert", p, "kernel") for p in ("gate_proj", "up_proj", "down_proj")]
    if cfg.shared_expert_gate:
        paths.append((l, "mlp", "shared_expert_gate", "kernel"))
    return paths


def _check_complete(params: dict, cfg: ModelConfig) -> None:
    missing = []
    for path in expected_paths(cfg):
        node = params
        for key in path:
            if not isinstance(node, dict) or key not in node:
                missing.append("/".join(path))
                break
            node = node[key]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UserError(f"The checkpoint is missing weights the model needs: {shown}.")
