"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) in Flax, over a paged KV cache.

One forward serves a ragged batch: T new tokens from any mix of prefill chunks and decodes. Each
layer writes its K/V into its own cache arrays (donated by the caller, so updated in place) and
attends through the configured attention backend. Only the rows in `logits_indices` reach the
LM head.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.runtime.attention import AttentionFn, AttentionMetadata
from jaxserve.runtime.cpu_kernels import PANEL, cpu_matmul, cpu_matmul_gated, packable


def real_tokens(md: AttentionMetadata):
    """i32[1]: the step's real tokens; rows past them are bucket padding."""
    return md.query_start_loc[md.num_seqs]


def rope_tables(positions, inv_freq):
    """cos and signed sin at full head width for `apply_rope`: [T, D] each (computed once per step)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    c, s = jnp.cos(freqs), jnp.sin(freqs)
    return jnp.concatenate([c, c], axis=-1), jnp.concatenate([-s, s], axis=-1)


def apply_rope(x, cos, sin):
    """HF's rotate-half convention, [x1 c - x2 s, x2 c + x1 s], as x * cos + [x2, x1] * sin over the
    full width (XLA:CPU runs this form ~4x faster than concatenating the two halves' results).
    x: [T, H, D]; cos/sin: [T, D] from `rope_tables`."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = x * cos[:, None, :] + jnp.concatenate([x2, x1], axis=-1) * sin[:, None, :]
    return out.astype(x.dtype)


class Linear(nn.Module):
    """nn.Dense's parameters ("kernel" [K, N], optional "bias"). With `packed` (the native CPU
    matmul, runtime/cpu_kernels.py), kernels whose N is a multiple of 64 are held as panels
    [N / 64, K, 64] (`pack_kernel`, done by the runner at load time) and run by `cpu_matmul`.
    `MLP` reads the gate and up kernels directly to run both in one gated call."""

    in_features: int
    features: int
    use_bias: bool
    dtype: Any
    packed: bool = False

    @property
    def is_packed(self) -> bool:
        return self.packed and packable((self.in_features, self.features))

    def setup(self):
        k, n = self.in_features, self.features
        shape = (n // PANEL, k, PANEL) if self.is_packed else (k, n)
        self.kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, self.dtype)
        if self.use_bias:
            self.bias = self.param("bias", nn.initializers.zeros, (n,), self.dtype)

    def __call__(self, x, num_rows=None):
        """num_rows (i32[1]): the real (non-padding) rows of x, all that the packed path computes."""
        x = x.astype(self.dtype)
        y = cpu_matmul(x, self.kernel, num_rows) if self.is_packed else jnp.dot(x, self.kernel)
        return y + self.bias if self.use_bias else y


class Embed(nn.Module):
    """nn.Embed's parameter ("embedding" [V, H]). With `packed` (a tied table whose V is a multiple
    of 64) the table is held once, as the LM head's panels of its transpose [V / 64, H, 64], so
    `attend` runs `cpu_matmul`; token rows are gathered from the panels."""

    num_embeddings: int
    features: int
    dtype: Any
    packed: bool = False

    def setup(self):
        v, h = self.num_embeddings, self.features
        shape = (v // PANEL, h, PANEL) if self.packed else (v, h)
        self.embedding = self.param("embedding", nn.initializers.normal(1.0), shape, self.dtype)

    def __call__(self, ids):
        if self.packed:
            return self.embedding[ids // PANEL, :, ids % PANEL]
        return jnp.take(self.embedding, ids, axis=0)

    def attend(self, x, num_rows=None):
        x = x.astype(self.dtype)
        return cpu_matmul(x, self.embedding, num_rows) if self.packed else jnp.dot(x, self.embedding.T)


class Attention(nn.Module):
    cfg: ModelConfig
    attn_fn: AttentionFn
    dtype: Any
    packed: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, kv, md: AttentionMetadata, rows):
        c = self.cfg
        dense = lambda k, n, name, bias: Linear(k, n, bias, self.dtype, self.packed, name=name)  # noqa: E731
        t, q_dim, kv_dim = x.shape[0], c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = dense(c.hidden_size, q_dim, "q_proj", c.attention_bias)(x, rows).reshape(t, c.num_heads, c.head_dim)
        k = dense(c.hidden_size, kv_dim, "k_proj", c.attention_bias)(x, rows).reshape(t, c.num_kv_heads, c.head_dim)
        v = dense(c.hidden_size, kv_dim, "v_proj", c.attention_bias)(x, rows).reshape(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.dtype, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o, k_pages, v_pages = self.attn_fn(
            q, k, v, kv[0], kv[1], md, sm_scale=c.head_dim**-0.5, sliding_window=c.sliding_window
        )
        out = dense(q_dim, c.hidden_size, "o_proj", False)(o.reshape(t, q_dim), rows)
        return out, (k_pages, v_pages)


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * w.astype(jnp.float32)).astype(self.dtype)


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Any
    packed: bool = False

    @nn.compact
    def __call__(self, x, num_rows=None):
        dense = lambda k, n, name: Linear(k, n, False, self.dtype, self.packed, name=name)  # noqa: E731
        h, i = self.cfg.hidden_size, self.cfg.intermediate_size
        gate, up = dense(h, i, "gate_proj"), dense(h, i, "up_proj")
        if gate.is_packed:  # SiLU-and-multiply inside the matmul, on each tile
            act = cpu_matmul_gated(x.astype(self.dtype), gate.kernel, up.kernel, num_rows)
        else:
            act = nn.silu(gate(x, num_rows)) * up(x, num_rows)
        return dense(i, h, "down_proj")(act, num_rows)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    attn_fn: AttentionFn
    dtype: Any
    packed: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, kv, md, rows):
        c = self.cfg
        h, kv = Attention(c, self.attn_fn, self.dtype, self.packed, name="self_attn")(
            RMSNorm(c.rms_norm_eps, self.dtype, name="input_layernorm")(x), cos, sin, kv, md, rows
        )
        x = x + h
        x = x + MLP(c, self.dtype, self.packed, name="mlp")(
            RMSNorm(c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x), rows
        )
        return x, kv


class LlamaForCausalLM(nn.Module):
    cfg: ModelConfig
    attn_fn: AttentionFn
    dtype: Any = jnp.float32
    packed: bool = False  # linear kernels as panels for the native CPU matmul (see Linear)

    @nn.compact
    def __call__(
        self,
        input_ids,  # i32[T]
        positions,  # i32[T]
        kv_caches,  # list of (k_pages, v_pages) per layer
        md: AttentionMetadata,
        logits_indices,  # i32[S] rows that sample
        inv_freq,  # f32[D/2]
    ):
        c = self.cfg
        tied_packed = self.packed and c.tie_word_embeddings and packable((c.hidden_size, c.vocab_size))
        embed = Embed(c.vocab_size, c.hidden_size, self.dtype, tied_packed, name="embed_tokens")
        x = embed(input_ids)
        cos, sin = rope_tables(positions, inv_freq)
        rows = real_tokens(md)  # once per step, for every packed matmul
        new_caches = []
        for i in range(c.num_layers):
            x, kv = DecoderLayer(c, self.attn_fn, self.dtype, self.packed, name=f"layers_{i}")(
                x, cos, sin, kv_caches[i], md, rows
            )
            new_caches.append(kv)
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x[logits_indices])
        if c.tie_word_embeddings:
            logits = embed.attend(x, md.num_seqs)
        else:
            logits = Linear(c.hidden_size, c.vocab_size, False, self.dtype, self.packed, name="lm_head")(x, md.num_seqs)
        return logits.astype(jnp.float32), new_caches
