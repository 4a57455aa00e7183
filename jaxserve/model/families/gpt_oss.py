"""gpt-oss (`GptOssForCausalLM`, openai/gpt-oss-20b and -120b): every layer MoE; attention with
q/k/v/o biases and a learned per-head sink logit in the softmax denominator (`self_attn.sinks`),
sliding-window (128) and full layers alternating (`layer_types`), YaRN RoPE; a biased router
whose top-k logits are softmaxed; experts with biases and the clamped SwiGLU
  (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
with gate and up interleaved in `gate_up_proj`'s output axis (even: gate, odd: up), as HF stores
them. Two checkpoint layouts: HF's float one (`experts.gate_up_proj` [E, H, 2I], ...) and the
MXFP4 one the official checkpoints ship (`experts.gate_up_proj_blocks` / `_scales`, kept packed:
runtime/mxfp4.py)."""

from __future__ import annotations

import re

import numpy as np

from jaxserve.runtime import mxfp4

MODEL_TYPES = {"gpt_oss": "GptOssForCausalLM"}

_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)$")
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_SPLIT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj|gate_bias|up_bias|down_bias)$")
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks$")


def is_mxfp4(hf: dict) -> bool:
    return (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def config(hf: dict) -> dict:
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return dict(
        attention_bias=bool(hf.get("attention_bias", True)),
        o_proj_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        layer_types=tuple(types[:n]),
        sliding_window=int(hf.get("sliding_window") or 128),
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["intermediate_size"]),
        moe_layers=tuple(range(n)),
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_act="swiglu_clamp",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        expert_format="mxfp4" if is_mxfp4(hf) else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def transform_weights(weights: dict) -> dict:
    """HF's stacked expert tensors -> gate / up / down (and their biases) apart: the interleaved
    gate_up output axis split into its even (gate) and odd (up) columns, float or MXFP4."""
    out = {}
    for name, w in weights.items():
        m = _EXPERTS.match(name)
        if m is None:
            out[name] = w
            continue
        prefix, proj, kind = name[: m.start(2)], m[2], m[3] or ""
        if kind == "_scales":
            continue  # read with its _blocks
        if kind == "_blocks":
            packed = mxfp4.Mxfp4Weight(np.asarray(w, np.uint8), np.asarray(weights[f"{prefix}{proj}_scales"], np.uint8))
            if proj == "gate_up_proj":
                out[prefix + "gate_proj"], out[prefix + "up_proj"] = mxfp4.deinterleave_rows(packed)
            else:
                out[prefix + "down_proj"] = packed
        elif kind == "_bias":  # [E, 2I] interleaved, or [E, H]
            if proj == "gate_up_proj":
                out[prefix + "gate_bias"], out[prefix + "up_bias"] = w[..., 0::2], w[..., 1::2]
            else:
                out[prefix + "down_bias"] = w
        elif proj == "gate_up_proj":  # float [E, H, 2I]
            out[prefix + "gate_proj"], out[prefix + "up_proj"] = w[..., 0::2], w[..., 1::2]
        else:
            out[prefix + "down_proj"] = w
    return out


def param_path(name: str):
    if m := _ROUTER.match(name):
        return (f"layers_{m[1]}", "mlp", "gate", "kernel" if m[2] == "weight" else "bias"), None
    if m := _SPLIT.match(name):
        return (f"layers_{m[1]}", "mlp", "experts", m[2]), None
    if m := _SINKS.match(name):
        return (f"layers_{m[1]}", "self_attn", "sinks"), None
    return None
