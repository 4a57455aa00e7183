"""ModelConfig: the numbers a decoder needs, read from an HF `config.json` dict.

The fields every family shares are read here; each family module (model/families/) adds its own
(q/k norm, biases, the MoE's experts and router). GGUF files are first turned into such a dict by
the GGUF loader, so there is one path from a config to a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.errors import UserError
from jaxserve.model import families, rope

SUPPORTED_ARCHITECTURES = families.ARCHITECTURES


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    checkpoint_dtype: str | None = None  # the weights' dtype as stored (config "torch_dtype"), if known
    # mixture of experts (model/moe.py); num_experts 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE block (the others are dense)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # softmax | topk_softmax (gpt-oss) | sigmoid (DeepSeek-V3 / GLM-4.5: correction bias, grouped top-k)
    router: str = "softmax"
    n_group: int = 1  # sigmoid router: expert groups, of which topk_group are kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x W)
    partial_rotary_factor: float = 1.0  # GLM-4.5: RoPE on the first head_dim * factor dims only
    expert_parallel: bool = False  # how it runs: experts split over the model axis (model/sharding.py)
    # per-layer attention pattern (Gemma 3, gpt-oss): empty = every layer alike (sliding_window if set)
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base (None: the global one)
    local_rope_scaling: dict | None = None
    attn_soft_cap: float | None = None  # tanh soft cap on attention scores
    final_soft_cap: float | None = None  # tanh soft cap on the logits
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (default head_dim)
    # Gemma: RMSNorm scales by (1 + w), embeddings times sqrt(hidden), norms after attention and
    # around the MLP, gelu-tanh MLP
    gemma_norms: bool = False
    hidden_act: str = "silu"  # silu | gelu_tanh
    # gpt-oss: per-head learned attention sinks, a bias on o_proj too, a biased router whose softmax
    # runs over the top-k logits ("topk_softmax"), experts with biases and the clamped SwiGLU
    attention_sinks: bool = False
    o_proj_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"  # silu | swiglu_clamp (gpt-oss: (up + 1) * g * sigmoid(alpha g), clamped)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_format: str | None = None  # "mxfp4": routed experts kept packed as stored (runtime/mxfp4.py)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        model_type = hf.get("model_type")
        family = families.family(model_type)
        if family is None:
            archs = hf.get("architectures") or [model_type]
            raise UserError(
                f"Unsupported model architecture {archs[0]!r} (model_type={model_type!r}) in {source}. "
                f"jaxserve supports: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
            )
        if hasattr(family, "text_config"):  # a multimodal checkpoint: its text tower's fields
            hf = family.text_config(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        common = dict(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(
                hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0
            ),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=_checkpoint_dtype(hf),
        )
        return cls(**(common | family.config(hf)))  # a family may override a common field

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i in self.moe_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V for every layer (the engine multiplies by dtype size / 4)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: global attention)."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

    @property
    def rope_kinds(self) -> tuple[tuple[float, dict | None], ...]:
        """(theta, scaling) of each RoPE kind: the global one, then the local layers' if they differ."""
        kinds = ((self.rope_theta, self.rope_scaling),)
        if self.local_rope_theta is not None:
            kinds += ((self.local_rope_theta, self.local_rope_scaling),)
        return kinds

    def layer_rope(self, i: int) -> int:
        """Which row of `rope_inv_freq()` layer i rotates with."""
        return int(len(self.rope_kinds) > 1 and self.layer_window(i) is not None)

    def rope_inv_freq(self) -> np.ndarray:
        """f64[K, R/2]: the inverse frequencies of each RoPE kind (`rope_kinds`), scaling applied, over
        the rotary dims R (all of head_dim unless partial_rotary_factor < 1)."""
        return np.stack([rope.inv_freq(t, self.rotary_dim, s, self.max_position_embeddings)[0]
                         for t, s in self.rope_kinds])

    def rope_attention_factors(self) -> tuple[float, ...]:
        """Each RoPE kind's factor on cos and sin (YaRN's attention scaling; 1 otherwise)."""
        return tuple(rope.inv_freq(t, self.rotary_dim, s, self.max_position_embeddings)[1]
                     for t, s in self.rope_kinds)

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def _rope_scaling(hf: dict) -> dict | None:
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    return None if kind in (None, "default") else dict(rs)


def _checkpoint_dtype(hf: dict) -> str | None:
    """"float32" / "bfloat16" / "float16" from config.json's "torch_dtype" (newer transformers: "dtype")."""
    name = str(hf.get("torch_dtype") or hf.get("dtype") or "").removeprefix("torch.")
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    return name if name in ("float32", "bfloat16", "float16") else None
