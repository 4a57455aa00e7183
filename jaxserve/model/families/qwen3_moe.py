"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3 attention (q/k norm, no
bias), softmax top-k routing renormalised over the k (norm_topk_prob), no shared expert; layers in
`mlp_only_layers` (or off the `decoder_sparse_step`) keep a dense MLP."""

from __future__ import annotations

import re

MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM"}

_DENSE = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight$")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def num_experts(hf: dict) -> int:
    """config.json's num_experts (transformers 5 writes it as num_local_experts)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def sparse_layers(hf: dict) -> tuple[int, ...]:
    """Qwen's rule: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th."""
    step, dense = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or ())
    n = int(hf["num_hidden_layers"])
    if not num_experts(hf):
        return ()
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)


def config(hf: dict) -> dict:
    return dict(
        qk_norm=True,
        attention_bias=bool(hf.get("attention_bias", False)),
        num_experts=num_experts(hf),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_layers=sparse_layers(hf),
    )


def moe_param_path(name: str):
    """Names shared by the Qwen MoE families: the router and the routed experts, stacked [E, ...]."""
    if m := _ROUTER.match(name):
        return (f"layers_{m[1]}", "mlp", "gate", "kernel"), None
    if m := _EXPERT.match(name):
        return (f"layers_{m[1]}", "mlp", "experts", m[3]), int(m[2])
    if m := _DENSE.match(name):  # a dense layer (mlp_only_layers)
        return (f"layers_{m[1]}", "mlp", m[2], "kernel"), None
    return None


param_path = moe_param_path
