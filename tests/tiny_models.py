"""Small random-initialised HF models (with a real BPE tokenizer) saved to disk, for tests.

Each is a genuine HF checkpoint: config.json + model.safetensors + tokenizer files, loadable by
transformers (the numerical reference) and by jaxserve.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "JAX is a library for array computation and program transformation.",
    "def add(a, b):\n    return a + b\n",
    "Caf\u00e9, na\u00efve, r\u00e9sum\u00e9 \u2014 \u6771\u4eac \U0001F600 numbers 12345 and symbols !?#",
    "Once upon a time there was a small model that learned to count: one, two, three, four.",
] * 20

ARCH = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False)),
    "llama3": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": dict(cls="MistralConfig", extra=dict(sliding_window=None)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=True)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=False, head_dim=32)),
    # YaRN: 4x an original context of 32 tokens, so the tests' positions lie past it
    "qwen3_yarn": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=False, head_dim=32, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0))),
    # mixture of experts: 8 experts, top-2, one dense layer in Qwen2-MoE's mix
    "qwen3_moe": dict(cls="Qwen3MoeConfig", extra=dict(tie_word_embeddings=False, head_dim=32, num_experts=8,
                                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                                       norm_topk_prob=True)),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", extra=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                       mlp_only_layers=[1])),
    # sigmoid routing over 8 experts in 4 groups (top 2 groups), a shared expert, layer 0 dense,
    # RoPE on half of each head
    "glm4_moe": dict(cls="Glm4MoeConfig", extra=dict(n_routed_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32,
                                                     n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                                                     topk_group=2, routed_scaling_factor=2.0, head_dim=32,
                                                     tie_word_embeddings=False)),
    # GLM-4.5 as llama.cpp's GGUF stores it (model/gguf_arch.py): no expert groups (n_group 1)
    "glm4_moe_gguf": dict(cls="Glm4MoeConfig", extra=dict(n_routed_experts=8, num_experts_per_tok=2,
                                                          moe_intermediate_size=32, n_shared_experts=1,
                                                          first_k_dense_replace=1, n_group=1, topk_group=1,
                                                          routed_scaling_factor=2.0, head_dim=32,
                                                          tie_word_embeddings=False)),
    # Gemma 3: head_dim 256, layers sliding (window 20: straddles the 16-token KV blocks) / global /
    # sliding / global, each kind its own RoPE, query_pre_attn_scalar != head_dim, a final soft cap
    # that bites; norm weights perturbed too (Gemma's (1 + w))
    "gemma3": dict(cls="Gemma3TextConfig", perturb_norms=True, extra=dict(
        head_dim=256, sliding_window=20, query_pre_attn_scalar=144, final_logit_softcapping=2.0,
        sliding_window_pattern=2,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    # Gemma 3 as llama.cpp's GGUF stores it (model/gguf_arch.py): every 6th layer global, scores scaled
    # by head_dim^-1/2; local RoPE 10k, global 1M linearly scaled; a final soft cap that bites
    "gemma3_gguf": dict(cls="Gemma3TextConfig", perturb_norms=True, extra=dict(
        head_dim=256, sliding_window=20, query_pre_attn_scalar=256, final_logit_softcapping=2.0,
        sliding_window_pattern=6,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    # gpt-oss: 8 experts top 2, sliding (window 8) / full layers alternating, YaRN 4x an original
    # context of 16, a SwiGLU clamp low enough to bite; biases and sinks perturbed (spec below)
    "gpt_oss": dict(cls="GptOssConfig", perturb_biases=True, extra=dict(
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                        original_max_position_embeddings=16,
                                                        rope_theta=10000.0, beta_fast=32.0, beta_slow=1.0,
                                                        truncate=False))),
    "mixtral": dict(cls="MixtralConfig", extra=dict(num_local_experts=4, num_experts_per_tok=2,
                                                    sliding_window=None)),
}


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", chat_template=template,
    )


def make_tiny_model(path: Path, arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, max_pos: int = 512, seed: int = 0, std: float = 0.08,
                    vocab_size: int | None = None) -> Path:
    """vocab_size: the model's rows (default the tokenizer's; larger = a padded vocabulary)."""
    import torch
    import transformers

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tok = build_tokenizer()
    spec = ARCH[arch]
    cfg = getattr(transformers, spec["cls"])(
        vocab_size=vocab_size or len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **spec["extra"],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all ~0
        for p in model.parameters():
            if p.dim() >= 2:  # 3-D: stacked experts
                p.normal_(0.0, std)
            elif spec.get("perturb_norms"):
                p.normal_(0.0, 0.1)
        for name, p in model.named_parameters():  # biases and attention sinks: not all zero
            if spec.get("perturb_biases") and p.dim() == 1 and "norm" not in name:
                p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
            elif spec.get("perturb_biases") and name.endswith("_bias"):  # stacked experts' [E, N]
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():  # a sigmoid router's correction bias: not all zero
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
