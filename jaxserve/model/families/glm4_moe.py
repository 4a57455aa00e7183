"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): the sigmoid-routed family with shared experts.
Attention with q/k/v bias (optional q/k norm) and RoPE on the first half of each head
(partial_rotary_factor 0.5); the first `first_k_dense_replace` layers dense, the rest MoE: sigmoid
scores plus a per-expert correction bias choose the top k within the best `topk_group` of `n_group`
expert groups, the weights (unbiased scores, renormalised) times routed_scaling_factor, and
`n_shared_experts` shared experts (one MLP of n x moe_intermediate_size, no gate). The
multi-token-prediction layer past the decoder is not loaded."""

from __future__ import annotations

import re

from jaxserve.model.families.qwen3_moe import moe_param_path

MODEL_TYPES = {"glm4_moe": "Glm4MoeForCausalLM"}

_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")


def config(hf: dict) -> dict:
    n = int(hf["num_hidden_layers"])
    rope = hf.get("rope_parameters") or {}
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    return dict(
        attention_bias=bool(hf.get("attention_bias", True)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        partial_rotary_factor=float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5),
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        router="sigmoid",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        shared_expert_intermediate_size=int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts") or 0),
        moe_layers=tuple(range(int(hf.get("first_k_dense_replace") or 0), n)) if experts else (),
    )


def param_path(name: str):
    if m := _BIAS.match(name):
        return (f"layers_{m[1]}", "mlp", "e_score_correction_bias"), None
    if m := _SHARED.match(name):
        return (f"layers_{m[1]}", "mlp", "shared_expert", m[2], "kernel"), None
    return moe_param_path(name)
