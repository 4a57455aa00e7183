"""Map HF-named weights (from safetensors or the GGUF loader) onto the Flax parameter tree."""

from __future__ import annotations

from jaxserve.errors import UserError
import re

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.runtime.quant import is_quantized

_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_LAYER_NORM = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")
_QK_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")


def param_path(name: str) -> tuple[str, ...] | None:
    """HF tensor name -> (path in the Flax tree). None for tensors the model does not use."""
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
    if m := _LAYER.match(name):
        return (f"layers_{m[1]}", m[2], m[3], "kernel" if m[4] == "weight" else "bias")
    return None  # e.g. rotary_emb.inv_freq in old checkpoints


def hf_to_params(hf_weights, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Build the nested param dict (numpy, on host). Linear weights go from [out, in] to [in, out];
    quantized ones (runtime/quant.py) come in their kernel layout and are kept as they are."""
    params: dict = {}
    for name, w in hf_weights.items():
        path = param_path(name)
        if path is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if is_quantized(w):  # already in its kernel layout (a GGUF's blocks, runtime/quant.py)
            node[path[-1]] = w
            continue
        w = np.asarray(w)
        node[path[-1]] = np.ascontiguousarray(w.T if path[-1] == "kernel" else w, dtype=dtype)
    _check_complete(params, cfg)
    return params


def expected_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    paths = [("embed_tokens", "embedding"), ("norm", "weight")]
    if not cfg.tie_word_embeddings:
        paths.append(("lm_head", "kernel"))
    for i in range(cfg.num_layers):
        l = f"layers_{i}"
        paths += [(l, "input_layernorm", "weight"), (l, "post_attention_layernorm", "weight")]
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            paths.append((l, "self_attn", p, "kernel"))
        if cfg.attention_bias:
            paths += [(l, "self_attn", p, "bias") for p in ("q_proj", "k_proj", "v_proj")]
        if cfg.qk_norm:
            paths += [(l, "self_attn", "q_norm", "weight"), (l, "self_attn", "k_norm", "weight")]
        paths += [(l, "mlp", p, "kernel") for p in ("gate_proj", "up_proj", "down_proj")]
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
