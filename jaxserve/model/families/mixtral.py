"""Mixtral (8x7B, 8x22B): Mistral attention, a `block_sparse_moe` in every layer with softmax top-2
routing renormalised over the two; experts' w1 / w3 / w2 are gate / up / down."""

from __future__ import annotations

import re

MODEL_TYPES = {"mixtral": "MixtralForCausalLM"}

_ROUTER = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def config(hf: dict) -> dict:
    sliding = hf.get("sliding_window")
    return dict(
        sliding_window=int(sliding) if sliding else None,
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=tuple(range(int(hf["num_hidden_layers"]))),
    )


def param_path(name: str):
    if m := _ROUTER.match(name):
        return (f"layers_{m[1]}", "mlp", "gate", "kernel"), None
    if m := _EXPERT.match(name):
        return (f"layers_{m[1]}", "mlp", "experts", _PROJ[m[3]]), int(m[2])
    return None
