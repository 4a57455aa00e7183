"""The Llama family's model (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) is the shared decoder
(model/decoder.py); its config and names are model/families/llama.py. Kept for its import path."""

from jaxserve.model.decoder import CausalLM, DecoderLayer
from jaxserve.model.layers import MLP, Attention, Embed, Linear, RMSNorm, real_tokens, rope_tables
from jaxserve.runtime.rope_fusion import apply_rope

LlamaForCausalLM = CausalLM

__all__ = ["LlamaForCausalLM", "CausalLM", "DecoderLayer", "MLP", "Attention", "Embed", "Linear", "RMSNorm",
           "apply_rope", "real_tokens", "rope_tables"]
