"""Model families: one module each, saying how an HF checkpoint's config and tensor names map onto
the shared building blocks (model/layers.py, model/moe.py, composed by model/decoder.py).

A family module defines
  MODEL_TYPES: {config.json model_type: HF architecture name}
  config(hf) -> dict      ModelConfig fields read from its config.json beyond the common ones
  param_path(name) -> (path in the Flax tree, expert index or None) | None   for its MLP tensors
                          (attention, norms, embedding and LM head are common: model/weights.py)
and optionally
  text_config(hf) -> dict    the decoder's config.json fields (a multimodal config's text tower)
  canonical_name(name) -> str | None   a tensor name in the decoder-only form (None: not used)
  transform_weights(weights) -> weights   tensors split or re-packed before the name map (gpt-oss)
Adding a family is adding a module here and its name to FAMILIES.
"""

from __future__ import annotations

from types import ModuleType

from jaxserve.model.families import gemma3, glm4_moe, gpt_oss, llama, mixtral, qwen2_moe, qwen3_moe

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3_moe, qwen2_moe, mixtral, glm4_moe, gemma3, gpt_oss)
BY_MODEL_TYPE: dict[str, ModuleType] = {t: f for f in FAMILIES for t in f.MODEL_TYPES}
ARCHITECTURES: dict[str, str] = {t: a for f in FAMILIES for t, a in f.MODEL_TYPES.items()}


def family(model_type: str | None) -> ModuleType | None:
    return BY_MODEL_TYPE.get(model_type or "")
