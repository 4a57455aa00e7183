"""Building blocks every model family composes: linear, embedding, RMSNorm, RoPE, attention and the
dense gated MLP (the MoE block is model/moe.py). Each takes its backend-specific work as a callable of
`ModelOps` (runtime/backend.py); parameter names follow HF's, so a family's name map is short.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.runtime.attention import AttentionMetadata
from jaxserve.runtime.backend import ModelOps
from jaxserve.runtime.rope_fusion import Rope
from jaxserve.runtime.row_fusion import RowNorm


def real_tokens(md: AttentionMetadata):
    """i32[1]: the step's real tokens; rows past them are bucket padding."""
    return md.query_start_loc[md.num_seqs]


def rope_tables(positions, inv_freq, attention_factor: float = 1.0):
    """cos and signed sin at full head width for `apply_rope`: [T, D] each (computed once per step
    and RoPE kind); YaRN's attention factor scales both."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    c, s = jnp.cos(freqs), jnp.sin(freqs)
    if attention_factor != 1.0:
        c, s = c * attention_factor, s * attention_factor
    return jnp.concatenate([c, c], axis=-1), jnp.concatenate([-s, s], axis=-1)


def weight_param(mod: nn.Module, name: str, shape, dtype, init):
    """A parameter in whatever format the backend prepared it (a float array, or packed panels:
    runtime/backend.py); the declared float shape only initialises a fresh model."""
    if mod.has_variable("params", name):
        return mod.get_variable("params", name)
    return mod.param(name, init, shape, dtype)


class Linear(nn.Module):
    """nn.Dense's parameters ("kernel" [K, N], optional "bias"), multiplied by `ops.linear`."""

    in_features: int
    features: int
    use_bias: bool
    dtype: Any
    ops: ModelOps

    def setup(self):
        k, n = self.in_features, self.features
        self.kernel = weight_param(self, "kernel", (k, n), self.dtype, nn.initializers.lecun_normal())
        if self.use_bias:
            self.bias = self.param("bias", nn.initializers.zeros, (n,), self.dtype)

    def __call__(self, x, num_rows=None, norm: RowNorm | None = None, residual=None):
        """num_rows (i32[1]): the real (non-padding) rows of x, all that a native kernel computes;
        norm: x's rows normed first; residual: added to the output (runtime/row_fusion.py: the op
        fuses them where it can; after the bias, which it does not take)."""
        x = x.astype(self.dtype)
        if not self.use_bias:
            return self.ops.linear(x, self.kernel, num_rows, norm=norm, residual=residual).astype(self.dtype)
        y = self.ops.linear(x, self.kernel, num_rows, norm=norm).astype(self.dtype) + self.bias
        return y if residual is None else residual + y


class Embed(nn.Module):
    """nn.Embed's parameter ("embedding" [V, H]); `attend` is the tied LM head."""

    num_embeddings: int
    features: int
    dtype: Any
    ops: ModelOps

    def setup(self):
        shape = (self.num_embeddings, self.features)
        self.embedding = weight_param(self, "embedding", shape, self.dtype, nn.initializers.normal(1.0))

    def __call__(self, ids):
        return self.ops.embed(self.embedding, ids).astype(self.dtype)

    def attend(self, x, num_rows=None):
        return self.ops.lm_head(x.astype(self.dtype), self.embedding, num_rows)


class Attention(nn.Module):
    """One layer's attention, with that layer's window, RoPE tables (cos/sin) and soft cap."""

    cfg: ModelConfig
    dtype: Any
    ops: ModelOps
    index: int = 0

    @nn.compact
    def __call__(self, x, cos, sin, kv, md: AttentionMetadata, rows, keep=None, keep_rows=None,
                 norm: RowNorm | None = None, residual=None):
        """keep / keep_rows (DecoderLayer): K/V written and attended for every row, the output
        projected for the kept rows alone. norm: x's rows normed first (by the q/k/v projections);
        residual: added to the output (its kept rows)."""
        c = self.cfg
        dense = lambda k, n, name, bias: Linear(k, n, bias, self.dtype, self.ops, name=name)  # noqa: E731
        t, q_dim, kv_dim = x.shape[0], c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        proj = lambda n, name: dense(c.hidden_size, n, name, c.attention_bias)(x, rows, norm)  # noqa: E731
        q = proj(q_dim, "q_proj").reshape(t, c.num_heads, c.head_dim)
        k = proj(kv_dim, "k_proj").reshape(t, c.num_kv_heads, c.head_dim)
        v = proj(kv_dim, "v_proj").reshape(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name="k_norm")(k)
        kw = {"rope": Rope(cos, sin)}  # the backend rotates q and k (runtime/rope_fusion.py)
        if c.attention_sinks:  # gpt-oss: one learned logit per head in the softmax denominator
            kw["sinks"] = self.param("sinks", nn.initializers.zeros, (c.num_heads,), jnp.float32)
        o, k_pages, v_pages = self.ops.attention(
            q, k, v, kv[0], kv[1], md, sm_scale=c.sm_scale, sliding_window=c.layer_window(self.index),
            soft_cap=c.attn_soft_cap, **kw,
        )
        o = o.reshape(t, q_dim)
        if keep is not None:
            o, rows = o[keep], keep_rows
            residual = None if residual is None else residual[keep]
        out = dense(q_dim, c.hidden_size, "o_proj", c.o_proj_bias)(o, rows, residual=residual)
        return out, (k_pages, v_pages)


class RMSNorm(nn.Module):
    """offset (Gemma): the scale is 1 + weight, the weight stored as a difference from 1."""

    eps: float
    dtype: Any
    offset: bool = False

    @nn.compact
    def __call__(self, x, apply: bool = True):
        """x's rows normed; apply=False: the norm itself (a RowNorm) for the linear layers that take
        x next, to apply as they read it (runtime/row_fusion.py)."""
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        w = self.param("weight", init, (x.shape[-1],), self.dtype).astype(jnp.float32)
        norm = RowNorm(1.0 + w if self.offset else w, self.eps)
        return norm(x).astype(self.dtype) if apply else norm


class MLP(nn.Module):
    """act(x W_gate) * (x W_up) W_down, act silu (one fused `ops.gated`) or Gemma's gelu-tanh;
    `intermediate_size` 0 means the config's (a shared expert passes its own)."""

    cfg: ModelConfig
    dtype: Any
    ops: ModelOps
    intermediate_size: int = 0

    @nn.compact
    def __call__(self, x, num_rows=None, norm: RowNorm | None = None, residual=None):
        """norm: x's rows normed first; residual: added to the output (runtime/row_fusion.py)."""
        dense = lambda k, n, name: Linear(k, n, False, self.dtype, self.ops, name=name)  # noqa: E731
        h, i = self.cfg.hidden_size, self.intermediate_size or self.cfg.intermediate_size
        gate, up = dense(h, i, "gate_proj"), dense(h, i, "up_proj")
        if self.cfg.hidden_act == "gelu_tanh":
            act = jax.nn.gelu(gate(x, num_rows, norm), approximate=True) * up(x, num_rows, norm)
        else:
            act = self.ops.gated(x.astype(self.dtype), gate.kernel, up.kernel, num_rows, norm=norm).astype(self.dtype)
        return dense(i, h, "down_proj")(act, num_rows, residual=residual)
