"""Gemma 3 text (`Gemma3ForCausalLM`, and the text tower of `Gemma3ForConditionalGeneration`
checkpoints): local sliding-window and global layers (5:1 by `sliding_window_pattern`, or
`layer_types`), each kind with its own RoPE (local base 10k; global 1M, linearly scaled on 4B+),
q/k RMSNorm, scores scaled by query_pre_attn_scalar^-1/2, RMSNorm as (1 + w), the embedding times
sqrt(hidden), norms after attention and around the gelu-tanh MLP, the final logits' tanh soft cap
if set. config.json's attn_logit_softcapping is not applied: transformers' Gemma3Attention never
passes it to attention (Gemma 2 did; every Gemma 3 checkpoint sets it null). The vision tower and
projector of the multimodal checkpoints are not loaded."""

from __future__ import annotations

import re

from jaxserve.errors import UserError

MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}

# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config lists only what differs.
TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
)
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
# the multimodal checkpoints' text tower: transformers 4 "language_model.model.*", 5 "model.language_model.*"
_TOWER = re.compile(r"^(?:language_model\.model|model\.language_model)\.")


def text_config(hf: dict) -> dict:
    """The text model's config.json fields, defaults filled in (a multimodal config's text_config;
    its top-level token ids and dtype win, as they are what generation uses)."""
    text = hf.get("text_config") or {}
    top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype") if hf.get(k) is not None}
    merged = TEXT_DEFAULTS | (hf if not text else text | top)
    return merged | {"model_type": hf["model_type"]}


def _rope(params: dict | None, theta: float, scaling: dict | None) -> tuple[float, dict | None]:
    params = dict(params or {})
    theta = float(params.pop("rope_theta", theta))
    kind = params.get("rope_type") or params.get("type") or "default"
    return theta, (None if kind == "default" else (scaling or {}) | params)


def config(hf: dict) -> dict:
    if hf.get("use_bidirectional_attention"):
        raise UserError("This Gemma 3 checkpoint uses bidirectional attention (EmbeddingGemma), which jaxserve "
                        "does not serve: use a causal Gemma 3 model.", param="model")
    n = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern") or 6)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n)]
    rp = hf.get("rope_parameters") or {}
    if "full_attention" not in rp and "sliding_attention" not in rp:  # the flat (transformers 4) form
        rp = {"full_attention": (hf.get("rope_scaling") or {}) | {"rope_theta": hf.get("rope_theta", 1e6)},
              "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", 1e4)}}
    theta, scaling = _rope(rp.get("full_attention"), 1e6, None)
    local_theta, local_scaling = _rope(rp.get("sliding_attention"), 1e4, None)
    soft = lambda k: float(hf[k]) if hf.get(k) else None  # noqa: E731
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        layer_types=tuple(types[:n]),
        sliding_window=int(hf["sliding_window"]) if hf.get("sliding_window") else None,
        qk_norm=True,
        attention_bias=bool(hf.get("attention_bias", False)),
        final_soft_cap=soft("final_logit_softcapping"),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
        gemma_norms=True,
        hidden_act="gelu_tanh",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def canonical_name(name: str) -> str | None:
    """A tensor name as Gemma3ForCausalLM writes it; None for the vision tower and projector."""
    if _TOWER.match(name):
        return _TOWER.sub("model.", name)
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")):
        return None
    return name


def param_path(name: str):
    if m := _MLP.match(name):
        return (f"layers_{m[1]}", "mlp", m[2], "kernel"), None
    return None
