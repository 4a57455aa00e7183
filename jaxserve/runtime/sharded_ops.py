"""A layer's attention and its routed experts under shard_map on the ("data", "model") mesh
(runtime/mesh.py): each device runs its own heads or experts, so XLA never gathers the KV cache or
the expert weights across devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.runtime.mesh import MODEL, page_spec, tp_size
from jaxserve.runtime.weight_formats import ExpertStack
from pallas_kernels.kv_quant import QuantPages


# ---- attention under shard_map ----------------------------------------------------------------
def shard_attention(attn_fn, mesh: Mesh, layout: str = "paged"):
    """Run a layer's attention (KV write + kernel) per model shard: each device writes and attends
    over its own q and kv heads.

    Same signature as `attention.layer_attention`'s function; the batch metadata is replicated.
    Needed for Pallas kernels and the native CPU kernel, and keeps XLA from ever gathering the
    cache across devices.
    """
    if tp_size(mesh) == 1:
        return attn_fn
    heads, rep = P(None, MODEL, None), P()

    def sharded(q, k, v, k_pages, v_pages, md, sinks=None, rope=None, **kw):
        pages = page_spec(layout, isinstance(k_pages, QuantPages))
        v_spec = rep if v_pages is None else pages  # tpu-fused: no V array (None)
        # per-head sinks (gpt-oss) go with their query heads; RoPE tables (per token) to every device
        extra = {"sinks": (sinks, P(MODEL)), "rope": (rope, rep)}
        extra = {name: a for name, a in extra.items() if a[0] is not None}

        def per_device(*a):
            return attn_fn(*a[:6], **kw, **dict(zip(extra, a[6:])))

        f = jax.shard_map(per_device, mesh=mesh,
                          in_specs=(heads, heads, heads, pages, v_spec, rep) + tuple(s for _, s in extra.values()),
                          out_specs=(heads, pages, v_spec), check_vma=False)
        return f(q, k, v, k_pages, v_pages, md, *(a for a, _ in extra.values()))

    return sharded


# ---- routed experts under shard_map ------------------------------------------------------------
def expert_specs(expert_parallel: bool, packed: bool = False) -> tuple[P, P, P]:
    """PartitionSpecs of the routed experts on the model axis: (gate / up, down, gate / up biases
    [E, I]). Expert parallel: whole experts (axis 0). Else the intermediate axis I: float gate / up
    [E, H, I] on axis 2, down [E, I, H] on axis 1; packed MXFP4 (runtime/mxfp4.py: blocks
    [E, N, K/32, 16], scales [E, N, K/32], the same spec for both) gate / up on N = I (axis 1) and
    down on its K/32 blocks (axis 2), so each device holds whole blocks with their scales."""
    if expert_parallel:
        return (P(MODEL), P(MODEL), P(MODEL)) if packed else (P(MODEL, None, None),) * 2 + (P(MODEL, None),)
    if packed:
        return P(None, MODEL), P(None, None, MODEL), P(None, MODEL)
    return P(None, None, MODEL), P(None, MODEL, None), P(None, MODEL)


def weight_spec(w, down: bool, expert_parallel: bool):
    """The spec (a pytree prefix of `w`) of one routed-expert weight: a float stack's or MXFP4's from
    `expert_specs`; an ExpertStack's per part (each part [E, N / 64, K-ish, ...] in panels, or a
    per-channel scale [E, N]): whole experts (axis 0) under expert parallelism, else gate / up on
    their panels and scales of N = I (axis 1), down on K = I (axis 2 of every blocked part, whole
    blocks: model/sharding.py pads I so they split), its per-channel scales [E, H] replicated."""
    if isinstance(w, ExpertStack):
        if expert_parallel:
            specs = [P(MODEL) for _ in w.w]
        elif down:
            specs = [P(None, None, MODEL) if a.ndim >= 3 else P() for a in w.w]
        else:
            specs = [P(None, MODEL) for _ in w.w]
        return ExpertStack(type(w.w)(*specs))
    w_in, w_out, _ = expert_specs(expert_parallel, packed=hasattr(w, "expert"))
    return w_out if down else w_in


def shard_moe(moe_fn, mesh: Mesh, expert_parallel: bool):
    """Run `ops.moe` (runtime/moe.py's signature) per device over its slice of the experts (whole
    experts with expert parallelism, else every expert's slice of the intermediate axis; float,
    MXFP4 or kept in a weight format: `weight_spec`), then sum
    the partial outputs over the model axis (see mesh.py's module docstring for why no all-to-all)."""
    if tp_size(mesh) == 1:
        return moe_fn
    rep = P()

    def sharded(x, ids, weights, w_gate, w_up, w_down, num_rows=None, biases=None, **kw):
        if num_rows is None:
            num_rows = jnp.full((1,), x.shape[0], jnp.int32)
        b_in = expert_specs(expert_parallel, packed=hasattr(w_gate, "expert"))[2]
        specs = [weight_spec(w, i == 2, expert_parallel) for i, w in enumerate((w_gate, w_up, w_down))]
        # expert parallel: every device's experts together (sizes the TPU grouped matmul's row tiles)
        total = {"num_experts": w_gate.shape[0]} if expert_parallel else {}

        def per_device(x, ids, weights, w_gate, w_up, w_down, num_rows, biases):
            offset = jax.lax.axis_index(MODEL) * w_gate.shape[0] if expert_parallel else 0
            y = moe_fn(x, ids, weights, w_gate, w_up, w_down, num_rows, expert_offset=offset, biases=biases,
                       **total, **kw)
            return jax.lax.psum(y, MODEL)

        b_spec = None if biases is None else (b_in, b_in)  # gpt-oss's gate / up biases split with their columns
        f = jax.shard_map(per_device, mesh=mesh, in_specs=(rep, rep, rep, *specs, rep, b_spec),
                          out_specs=rep, check_vma=False)
        return f(x, ids, weights, w_gate, w_up, w_down, num_rows, biases)

    return sharded
