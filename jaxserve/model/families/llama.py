"""Dense Llama-shaped decoders: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3 (q/k norm)."""

from __future__ import annotations

import re

MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def config(hf: dict) -> dict:
    t = hf["model_type"]
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return dict(
        attention_bias=bool(hf.get("attention_bias") or t == "qwen2"),
        qk_norm=t == "qwen3",
        sliding_window=int(sliding) if sliding and t == "mistral" else None,
    )


def param_path(name: str):
    if m := _MLP.match(name):
        return (f"layers_{m[1]}", "mlp", m[2], "kernel"), None
    return None
