"""The decoder every family runs, composed from model/layers.py and model/moe.py over a paged KV cache.

One forward serves a ragged batch: T new tokens from any mix of prefill chunks and decodes. Each
layer writes its K/V into its own cache arrays (donated by the caller, so updated in place) and
attends through `ops.attention`; its MLP is dense or the MoE block, as the config says per layer
(`ModelConfig.is_moe_layer`). Only the rows in `logits_indices` reach the LM head, so the last
layer, once its K/V are written for every row, runs its attention output projection, residual and
MLP on those rows alone (llama.cpp's output-row pruning): a prefill chunk's other rows feed nothing
after that layer (~3% of a 512-token prefill step on SmolLM2-135M's 30 layers; the native CPU
kernels compute every row alone, so there the kept rows' values do not change). Every
backend-specific operation comes in as a callable of `ModelOps` (runtime/backend.py).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import MLP, Attention, Embed, Linear, RMSNorm, real_tokens, rope_tables
from jaxserve.model.moe import MoE
from jaxserve.runtime.backend import ModelOps


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: Any
    ops: ModelOps
    index: int = 0

    @nn.compact
    def __call__(self, x, cos, sin, kv, md, rows, keep=None, keep_rows=None):
        """keep (i32[S]) and keep_rows (i32[1], the real ones): the rows whose output is needed
        (None: all); the layer's output then has those rows alone."""
        c = self.cfg
        norm = lambda name: RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name=name)  # noqa: E731
        moe = c.is_moe_layer(self.index)
        # A sublayer's input norm goes into its linear layers' rows and the residual add into its last
        # one's output (runtime/row_fusion.py), except where other ops read them: Gemma norms each
        # sublayer's output before its add, and an MoE block routes on the normed rows.
        h, kv = Attention(c, self.dtype, self.ops, self.index, name="self_attn")(
            x, cos, sin, kv, md, rows, keep, keep_rows, norm=norm("input_layernorm")(x, apply=False),
            residual=None if c.gemma_norms else x)
        if keep is not None:
            x, rows = x[keep], keep_rows
        mlp = (MoE if moe else MLP)(c, self.dtype, self.ops, name="mlp")
        if c.gemma_norms:
            x = x + norm("post_attention_layernorm")(h)
            pre = norm("pre_feedforward_layernorm")
            y = mlp(pre(x), rows) if moe else mlp(x, rows, pre(x, apply=False))
            return x + norm("post_feedforward_layernorm")(y), kv
        x = h  # x + attention
        if moe:
            return x + mlp(norm("post_attention_layernorm")(x), rows), kv
        return mlp(x, rows, norm("post_attention_layernorm")(x, apply=False), residual=x), kv


class CausalLM(nn.Module):
    cfg: ModelConfig
    ops: ModelOps  # from the backend (runtime/backend.py): linear, gated MLP, MoE, embed, LM head, attention
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        input_ids,  # i32[T]
        positions,  # i32[T]
        kv_caches,  # list of (k_pages, v_pages) per layer
        md,  # AttentionMetadata
        logits_indices,  # i32[S] rows that reach the LM head
        inv_freq,  # f32[K, R/2] per RoPE kind (ModelConfig.rope_inv_freq)
        num_logits=None,  # i32[1] of those in use (default: md.num_seqs)
        return_hidden: bool = False,  # also the rows' final-norm hidden states (pooling)
    ):
        c = self.cfg
        embed = Embed(c.vocab_size, c.hidden_size, self.dtype, self.ops, name="embed_tokens")
        x = embed(input_ids)
        if c.gemma_norms:
            x = x * jnp.asarray(c.hidden_size**0.5, self.dtype)
        tables = [rope_tables(positions, inv_freq[k], f) for k, f in enumerate(c.rope_attention_factors())]
        rows = real_tokens(md)  # once per step, for every native matmul and the MoE routing
        num_logits = md.num_seqs if num_logits is None else num_logits
        # fewer logits rows than tokens (a bucket that prefills): the last layer's output at those alone
        prune = logits_indices.shape[0] < input_ids.shape[0]
        new_caches = []
        for i in range(c.num_layers):
            cos, sin = tables[c.layer_rope(i)]
            keep = (logits_indices, num_logits) if prune and i == c.num_layers - 1 else (None, None)
            x, kv = DecoderLayer(c, self.dtype, self.ops, i, name=f"layers_{i}")(
                x, cos, sin, kv_caches[i], md, rows, *keep)
            new_caches.append(kv)
        x = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name="norm")(x if prune else x[logits_indices])
        if c.tie_word_embeddings:
            logits = embed.attend(x, num_logits)
        else:
            logits = Linear(c.hidden_size, c.vocab_size, False, self.dtype, self.ops, name="lm_head")(x, num_logits)
        logits = logits.astype(jnp.float32)
        if c.final_soft_cap:
            logits = c.final_soft_cap * jnp.tanh(logits / c.final_soft_cap)
        if return_hidden:
            return (logits, x.astype(jnp.float32)), new_caches
        return logits, new_caches
