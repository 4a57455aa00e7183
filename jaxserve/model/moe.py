"""The mixture-of-experts block: a router, the routed experts (stacked [E, ...], computed by
`ops.moe`, a grouped matmul: runtime/moe.py) and an optional shared expert with its sigmoid gate.

Parameters (HF names, experts stacked): gate/kernel [H, E] (the router),
experts/{gate_proj, up_proj} [E, H, I], experts/down_proj [E, I, H], and for the sigmoid router
e_score_correction_bias [E]; shared_expert/{gate,up,down}_proj/kernel, shared_expert_gate/kernel [H, 1];
gpt-oss: gate/bias [E], experts/{gate_bias, up_bias} [E, I], experts/down_bias [E, H]. The experts
may be a packed format (runtime/mxfp4.py's MXFP4, or a weight format's ExpertStack: runtime/expert_matmul.py),
which `ops.moe` decodes where it multiplies.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import MLP, Linear, weight_param
from jaxserve.runtime.backend import ModelOps
from jaxserve.runtime.moe import route_sigmoid, route_softmax, route_topk_softmax, swiglu_clamp


class Experts(nn.Module):
    """The routed experts' stacked weights (not named "kernel": no dense-linear format applies)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: Any
    bias: bool = False

    def setup(self):
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        self.gate_proj = weight_param(self, "gate_proj", (e, h, i), self.dtype, init)
        self.up_proj = weight_param(self, "up_proj", (e, h, i), self.dtype, init)
        self.down_proj = weight_param(self, "down_proj", (e, i, h), self.dtype, init)
        if self.bias:
            zeros = nn.initializers.zeros
            self.gate_bias = self.param("gate_bias", zeros, (e, i), self.dtype)
            self.up_bias = self.param("up_bias", zeros, (e, i), self.dtype)
            self.down_bias = self.param("down_bias", zeros, (e, h), self.dtype)

    def __call__(self):
        return self.gate_proj, self.up_proj, self.down_proj

    def biases(self):
        """((b_gate, b_up), b_down), or None without biases."""
        return ((self.gate_bias, self.up_bias), self.down_bias) if self.bias else None


def route(cfg: ModelConfig, logits, bias=None):
    """(weights f32[T, k], ids i32[T, k]) from the router's logits f32[T, E]."""
    if cfg.router == "topk_softmax":
        return route_topk_softmax(logits, cfg.num_experts_per_tok)
    if cfg.router == "sigmoid":
        return route_sigmoid(logits, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                             cfg.norm_topk_prob, cfg.routed_scaling_factor)
    return route_softmax(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)


class MoE(nn.Module):
    cfg: ModelConfig
    dtype: Any
    ops: ModelOps

    @nn.compact
    def __call__(self, x, num_rows=None):
        c = self.cfg
        h, e = c.hidden_size, c.num_experts
        logits = Linear(h, e, c.router_bias, self.dtype, self.ops, name="gate")(x, num_rows)
        bias = None
        if c.router == "sigmoid":
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (e,), jnp.float32)
        weights, ids = route(c, logits, bias)
        experts = Experts(e, h, c.moe_intermediate_size, self.dtype, c.expert_bias, name="experts")
        w_gate, w_up, w_down = experts()
        kw = {}
        if c.expert_bias:
            kw["biases"], down_bias = experts.biases()
        if c.expert_act == "swiglu_clamp":
            kw["act"] = swiglu_clamp(c.swiglu_alpha, c.swiglu_limit)
        y = self.ops.moe(x.astype(self.dtype), ids, weights, w_gate, w_up, w_down, num_rows, **kw).astype(self.dtype)
        if c.expert_bias:  # each chosen expert's down bias, weighted as its output is
            y = y + jnp.einsum("tk,tkh->th", weights, down_bias[ids].astype(jnp.float32)).astype(self.dtype)
        if c.shared_expert_intermediate_size:
            shared = MLP(c, self.dtype, self.ops, c.shared_expert_intermediate_size, name="shared_expert")(x, num_rows)
            if c.shared_expert_gate:
                gate = Linear(h, 1, False, self.dtype, self.ops, name="shared_expert_gate")(x, num_rows)
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(self.dtype) * shared
            y = y + shared
        return y
