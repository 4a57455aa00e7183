"""Where each model parameter lives on the device mesh (`runtime/mesh.py`'s ("data", "model") axes).

The model axis shards the Llama family Megatron-style, and XLA's SPMD partitioner inserts the
collectives (one all-reduce after o_proj and after down_proj per layer, one all-gather of the
logits):

  q/k/v/gate/up kernels [in, out]   column-parallel   P(None, "model")   (biases P("model"))
  o/down kernels        [in, out]   row-parallel      P("model", None)
  embedding             [V, H]      vocab-parallel    P("model", None)
  lm_head kernel        [H, V]      vocab-parallel    P(None, "model")
  norms                             replicated
  KV cache    [blocks, bs, Hkv, D]  on kv heads       (runtime/mesh.py: kv_cache_sharding)

When tp > num_kv_heads the kv heads are replicated the way vLLM does it: each kv head is repeated
r = tp / num_kv_heads times (k/v projection columns and cache heads), so every device holds exactly
one kv head and the GQA grouping is unchanged (q head h still reads original kv head h // group).
Attention itself runs per shard under `shard_map` (each device attends its own heads; this is also
what a Pallas kernel needs).

Mixture-of-experts layers: the router and the shared expert's gate are replicated, a shared
expert shards like a dense MLP, and the routed experts [E, H, I] / [E, I, H] either split their
intermediate axis like a dense MLP (P(None, None, "model") / P(None, "model", None)) or, with
expert parallelism (`--enable-expert-parallel`, EP size = TP size as in vLLM), split the expert
axis (P("model", None, None)): each device holds E / tp whole experts. Either way `sharded_ops.shard_moe` runs
the grouped matmul per device under `shard_map`: the residual stream is replicated after the
attention's all-reduce, so dispatch is local (each device takes the rows routed to its experts)
and the combine is one all-reduce of [T, H] per MoE layer, the collective a row-parallel down_proj
costs anyway. An all-to-all dispatch pays off only once tokens are sharded (data-parallel
attention), which this mesh does not do.

MXFP4 experts (runtime/mxfp4.py: blocks [E, N, K/32, 16], scales [E, N, K/32]) shard as the float
experts do, in whole blocks with their scales (`sharded_ops.expert_specs`): whole experts under EP;
else gate / up on their N = I rows and down on its K/32 blocks, with I padded by zero blocks to a
multiple of 32 * tp where the blocks would not split evenly (`packed_intermediate`).

Routed experts kept in a weight format (weight_formats.ExpertStack: a GGUF's Q8_0 / Q4_K / ... blocks
as stored, w8a8 / w4a8 / bfloat16 made at load; each part [E, N / 64, K-ish, ...]) shard as stored
too (`sharded_ops.weight_spec`): whole experts under EP; else gate / up on their N = I panels (axis
1, per-channel scales with them), down on its K = I blocks (axis 2), with I padded by zero panels /
blocks to whole ones per device (model/expert_padding.py `stack_intermediate`: Qwen3-30B-A3B's 768
at TP 8 -> 1024 for Q8_0, 2048 for a K-quant's 256-value super-blocks; EP needs no padding).

Quantized weights (runtime/weight_formats.py: [N / 64, K-ish, ...] panels and their block scales) shard as
their float kernel would: a column-parallel N over the panel axis (and a per-channel scale [N]
with it), a row-parallel K over axis 1 of every part (quants, block and super-block scales alike),
so each device holds whole blocks with their own scales (`quantized_shardings`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.errors import UserError
from jaxserve.model.config import ModelConfig
from jaxserve.runtime import mxfp4, panels, weight_formats
from jaxserve.runtime.mesh import MODEL, map_paths, replicated, tp_size
from jaxserve.runtime.sharded_ops import expert_specs, weight_spec


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


# ---- layouts ----------------------------------------------------------------------------------
def _layout_problem(cfg: ModelConfig, tp: int) -> str | None:
    if cfg.num_heads % tp:
        return f"num_attention_heads={cfg.num_heads} is not divisible by {tp}"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return (f"num_key_value_heads={cfg.num_kv_heads} neither divides nor is divisible by {tp} "
                "(kv heads are split, or replicated when tp > kv heads)")
    if cfg.intermediate_size % tp and not (cfg.is_moe and len(cfg.moe_layers) == cfg.num_layers):
        return f"intermediate_size={cfg.intermediate_size} is not divisible by {tp}"
    if cfg.is_moe:
        if cfg.expert_parallel and cfg.num_experts % tp:
            return f"num_experts={cfg.num_experts} is not divisible by {tp} (expert parallel)"
        if not cfg.expert_parallel and cfg.moe_intermediate_size % tp and cfg.expert_format != "mxfp4":  # padded
            return (f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by {tp} "
                    "(--enable-expert-parallel splits whole experts instead)")
        if cfg.shared_expert_intermediate_size % tp:
            return f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is not divisible by {tp}"
    return None


def valid_tp_sizes(cfg: ModelConfig, limit: int | None = None) -> list[int]:
    limit = limit or cfg.num_heads
    return [t for t in range(1, limit + 1) if _layout_problem(cfg, t) is None]


def check_layout(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming the valid sizes when the model cannot be split tp ways."""
    problem = _layout_problem(cfg, tp)
    if problem:
        raise UserError(
            f"Cannot shard this model over tensor_parallel_size={tp}: {problem}. "
            f"Valid tensor parallel sizes for it: {', '.join(map(str, valid_tp_sizes(cfg)))}."
        )


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many times each kv head is repeated so the kv heads split evenly over tp devices."""
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def with_expert_parallel(cfg: ModelConfig, enable: bool) -> ModelConfig:
    """The config marked to run its experts expert-parallel; a UserError for a dense model."""
    if not enable:
        return cfg
    if not cfg.is_moe:
        raise UserError(f"enable_expert_parallel needs a mixture-of-experts model, but {cfg.model_type!r} has no "
                        "experts: drop --enable-expert-parallel.", param="enable_expert_parallel")
    return dataclasses.replace(cfg, expert_parallel=True)


def packed_intermediate(cfg: ModelConfig, tp: int) -> int:
    """The routed experts' intermediate size as the sharded model holds it: MXFP4 experts split on
    their intermediate axis (tensor, not expert, parallel) need whole 32-value blocks per device
    along the down projection's K, so I is padded up to a multiple of 32 * tp (gpt-oss-120b at TP 8:
    2880 -> 3072, 360 -> 384 per device, as vLLM pads it); the padded rows and blocks are zeros,
    which the clamped SwiGLU maps to exactly zero (`pad_packed_experts`)."""
    i = cfg.moe_intermediate_size
    if cfg.expert_format != "mxfp4" or cfg.expert_parallel or tp == 1:
        return i
    unit = mxfp4.BLOCK * tp
    return -(-i // unit) * unit


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with (kv heads repeated when tp > num_kv_heads; packed
    experts' intermediate size padded to whole blocks per device: `packed_intermediate`)."""
    check_layout(cfg, tp)
    r = kv_replication(cfg, tp)
    if r > 1:
        cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)
    i = packed_intermediate(cfg, tp)
    return cfg if i == cfg.moe_intermediate_size else dataclasses.replace(cfg, moe_intermediate_size=i)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> P:
    """PartitionSpec of one parameter (path in the Flax tree, e.g. layers_0/self_attn/q_proj/kernel)."""
    if tp == 1:
        return P()
    name, leaf = path[-2], path[-1]
    if name == "experts":  # stacked routed experts [E, H, I] (gate/up) or [E, I, H] (down), their biases
        w_in, w_out, b_in = expert_specs(cfg.expert_parallel)
        if leaf.endswith("_bias"):  # gpt-oss: [E, I] gate / up, [E, H] down
            return P() if leaf == "down_bias" and not cfg.expert_parallel else b_in
        return w_out if leaf == "down_proj" else w_in
    if name in COLUMN:
        return P(None, MODEL) if leaf == "kernel" else P(MODEL)
    if name in ROW and leaf == "kernel":
        return P(MODEL, None)
    if name in ("embed_tokens", "lm_head"):
        vocab_axis = 0 if name == "embed_tokens" else 1
        spec = [None, None]
        if shape[vocab_axis] % tp == 0:  # vocab-parallel
            spec[vocab_axis] = MODEL
        elif shape[1 - vocab_axis] % tp == 0:  # odd vocab: split the hidden axis instead
            spec[1 - vocab_axis] = MODEL
        return P(*spec)
    return P()  # norms, q/k norms, o/down biases (none in this family)


def _is_kv_proj(path) -> bool:
    return len(path) >= 2 and path[-2] in ("k_proj", "v_proj")


def expanded_shapes(shapes: dict, cfg: ModelConfig, r: int) -> dict:
    """Checkpoint shapes -> shapes after repeating each kv head r times."""
    def f(path, shape):
        if r > 1 and _is_kv_proj(path):
            return tuple(shape[:-1]) + (shape[-1] * r,)
        return shape

    return map_paths(shapes, f)


def param_shardings(shapes: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """NamedSharding per parameter, for the (kv-expanded) shapes the sharded model runs with."""
    tp = tp_size(mesh)
    return map_paths(shapes, lambda path, shape: NamedSharding(mesh, param_spec(path, shape, cfg, tp)))


def checkpoint_shardings(shapes: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Shardings to load the checkpoint's own shapes with: the target layout, except k/v
    projections are loaded replicated (they are small) when they still need repeating."""
    tp = tp_size(mesh)
    r = kv_replication(cfg, tp)

    def f(path, shape):
        if r > 1 and _is_kv_proj(path):
            return replicated(mesh)
        return NamedSharding(mesh, param_spec(path, shape, cfg, tp))

    return map_paths(shapes, f)


def quantized_specs(path: tuple[str, ...], w, cfg: ModelConfig, tp: int):
    """PartitionSpecs of a quantized weight's parts (a NamedTuple of them, like `w`): its float
    kernel's spec (param_spec) carried to the panels. A UserError names the weight and the valid
    sizes where tp would split a panel or a block."""
    q = w[0]
    k, n = jax.eval_shape(weight_formats.dequantize, w).shape

    def spec(shape):
        return (tuple(param_spec(path, shape, cfg, tp)) + (None, None))[:2]

    if path[-1] == "embedding":  # held as its LM head's [H, V] panels: vocab is N
        spec_n, spec_k = spec((n, k))
    else:
        spec_k, spec_n = spec((k, n))
    name = "/".join(path)
    parts = [a for a in w if a.ndim >= 2]
    splits = (spec_n and q.shape[0] % tp) or (spec_k and any(a.shape[1] % tp for a in parts))
    if splits and path[-2] in ("embed_tokens", "lm_head"):  # vocab panels do not divide: split the hidden
        # axis instead (as param_spec does for an odd vocab), or keep the table whole where its blocks do not
        spec_n, spec_k, splits = None, None if any(a.shape[1] % tp for a in parts) else MODEL, False
    if splits:
        count = q.shape[0] if spec_n else min(a.shape[1] for a in parts)  # panels, or K's coarsest blocks
        unit = f"{panels.PANEL}-column panels" if spec_n else f"blocks of {k // count} along K"
        fits = [t for t in valid_tp_sizes(cfg) if count % t == 0]
        raise UserError(f"tensor_parallel_size={tp} splits the {unit} of the quantized {name} "
                        f"({type(w).__name__}, K={k}, N={n}): use one of {', '.join(map(str, fits))}.",
                        param="tensor_parallel_size")
    return type(w)(*(P(spec_n) if a.ndim == 1 else P(spec_n, spec_k) for a in w))


def quantized_shardings(params, cfg: ModelConfig, mesh: Mesh):
    """NamedShardings for a tree holding quantized weights: theirs from `quantized_specs`, the
    float leaves' from param_spec."""
    tp = tp_size(mesh)

    def f(path, leaf):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        if isinstance(leaf, weight_formats.EXPERT_FORMATS):  # MXFP4 or an ExpertStack: whole blocks per device
            spec = weight_spec(leaf, names[-1] == "down_proj", cfg.expert_parallel) if tp > 1 else P()
            specs = jax.tree.map(lambda _: spec, leaf) if isinstance(spec, P) else spec
            return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        if weight_formats.is_quantized(leaf):
            return type(leaf)(*(NamedSharding(mesh, s) for s in quantized_specs(names, leaf, cfg, tp)))
        return NamedSharding(mesh, param_spec(names, tuple(leaf.shape), cfg, tp))

    return jax.tree_util.tree_map_with_path(f, params, is_leaf=weight_formats.is_quantized)


# ---- placing weights --------------------------------------------------------------------------
def repeat_kv_heads(params: dict, cfg: ModelConfig, r: int) -> dict:
    """A model with quantized weights, its k/v projections with each kv head repeated r times before
    placement (`expand_kv_heads` repeats float models' on device). Every part of a quantized kernel
    holds 64-column panels along axis 0 (per-column scales: columns), so a head of head_dim D is D /
    64 whole panels, repeated as stored (the same bytes: exact); float leaves (biases) by column."""
    if r == 1:
        return params
    d = cfg.head_dim

    def rep(a, unit: int, axis: int):  # [.., Hkv * unit, ..] -> [.., Hkv * r * unit, ..] along axis
        shape = a.shape[:axis] + (a.shape[axis] * r,) + a.shape[axis + 1:]
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(shape, a.dtype)
        xp = np if isinstance(a, np.ndarray) else jnp
        heads = a.reshape(a.shape[:axis] + (a.shape[axis] // unit, unit) + a.shape[axis + 1:])
        return xp.repeat(heads, r, axis=axis).reshape(shape)

    def f(path, w):
        if not _is_kv_proj(path):
            return w
        if not weight_formats.is_quantized(w):
            return rep(w, d, w.ndim - 1)
        if d % panels.PANEL:
            raise UserError(f"tensor_parallel_size > num_key_value_heads={cfg.num_kv_heads} repeats kv heads, which "
                            f"quantized k/v projections can only do in whole {panels.PANEL}-column panels, but "
                            f"head_dim is {d}: use a tensor parallel size that divides {cfg.num_kv_heads}, or "
                            "float weights.", param="tensor_parallel_size")
        return type(w)(*(rep(a, d if a.ndim == 1 else d // panels.PANEL, 0) for a in w))

    return map_paths(params, f)


def expand_kv_heads(params: dict, cfg: ModelConfig, r: int, target: dict) -> dict:
    """Repeat each kv head r times in k/v projections (kernel [H, Hkv*D], bias [Hkv*D]), on device,
    producing arrays already in their target (column-parallel) sharding. Abstract leaves
    (`jax.ShapeDtypeStruct`, for lowering) give the shapes the repeat would produce."""
    if r == 1:
        return params
    d = cfg.head_dim

    def rep(w):
        lead = w.shape[:-1]
        w = w.reshape(*lead, -1, d)
        return jnp.repeat(w, r, axis=-2).reshape(*lead, -1)

    def f(path, w):
        if not _is_kv_proj(path):
            return w
        node = target
        for k in path:
            node = node[k]
        put = jax.jit(rep, out_shardings=node)
        return jax.eval_shape(put, w) if isinstance(w, jax.ShapeDtypeStruct) else put(w)

    return map_paths(params, f)
