"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias), softmax top-k routing
(not renormalised by default), and a shared expert every token passes through, scaled by a
sigmoid gate of its own."""

from __future__ import annotations

import re

from jaxserve.model.families.qwen3_moe import moe_param_path, num_experts, sparse_layers

MODEL_TYPES = {"qwen2_moe": "Qwen2MoeForCausalLM"}

_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED_GATE = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight$")


def config(hf: dict) -> dict:
    return dict(
        attention_bias=bool(hf.get("qkv_bias", True)),
        num_experts=num_experts(hf),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=True,
        moe_layers=sparse_layers(hf),
    )


def param_path(name: str):
    if m := _SHARED.match(name):
        return (f"layers_{m[1]}", "mlp", "shared_expert", m[2], "kernel"), None
    if m := _SHARED_GATE.match(name):
        return (f"layers_{m[1]}", "mlp", "shared_expert_gate", "kernel"), None
    return moe_param_path(name)
