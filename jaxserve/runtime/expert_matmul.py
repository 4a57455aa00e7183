"""Routed experts kept in a weight format (weight_formats.ExpertStack: a GGUF's Q8_0 / Q4_K / ...
blocks as stored, or bfloat16 / w8a8 / w4a8 / ... made from float experts at load), multiplied
where they lie: no float copy of an expert is ever stored.

The grouped product takes `jax.lax.ragged_dot`'s operands (rows sorted by expert, rows per expert)
and, where the backend runs native linear layers, is one FFI call per projection
(csrc/quant_matmul.cc or csrc/dot_matmul.cc `*_grouped`, by the format's kernel): the kernel walks
the experts with rows, each expert's rows times its slice of the stacked weight, decoded in registers
(or on the dot-product instructions) exactly as the dense linear layer of that format, so a row's
result is that of `quant.linear` on the same expert's weight, bit for bit; the gate and up
projections run as one gated call (silu(x Wg) * (x Wu)). Under `packed_moe`'s native row moves
(route, gather, combine: csrc/moe_rows.cc) that gated call takes the layer's unsorted tokens and the
row order and reads row r as x[order[r] // k] while it prepares its activations (csrc/x_rows.h), so
no gathered copy of the rows is made for it; the down projection reads the gated rows as sorted.
Elsewhere (the xla backend, accelerators) the tiled product of runtime/moe.py multiplies each tile
by its expert's weight as `quant.linear` does there (dequantized inside the step; the dot formats'
activations quantized as their kernel does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime import cpu_kernels, quant
from jaxserve.runtime.moe import blocked_ragged_dot, grouped_experts
from jaxserve.runtime.panels import PANEL
from jaxserve.runtime.weight_formats import DOT_MATMUL, ExpertStack, expert_at, format_of

TARGETS = {"quant_matmul": "jaxserve_quant_matmul_grouped", "dot_matmul": "jaxserve_dot_matmul_grouped"}


def _tile_product(x, rhs: ExpertStack, i):
    """A tile of rows times expert i, as the xla backend's `quant.linear` computes it."""
    return quant.linear(x.astype(jnp.float32), expert_at(rhs.w, i), native=False)


def native_grouped(lhs, rhs: ExpertStack, group_sizes, up: ExpertStack | None = None,
                   isa: cpu_kernels.DotIsa | None = None, order=None):
    """The native grouped call: lhs f32[M, K] rows sorted by expert, rhs [E, K, N] stacked,
    group_sizes i32[E] -> f32[M, N] (rows past sum(group_sizes): zero); with `up` (same format),
    silu(lhs @ rhs_e) * (lhs @ up_e). With `order` i32[M] (a permutation of 0..M-1), lhs is the
    unsorted tokens f32[T, K] (M a multiple of T) and sorted row r is lhs[order[r] // (M // T)], read
    in place: the product of native_gather(lhs, order) bit for bit."""
    format = format_of(rhs.w)
    ops = format.operands(rhs.w)
    ups = format.operands(up.w) if up is not None else (jnp.zeros((0,), jnp.uint8),) * 3
    attrs = {"format": np.int32(format.id)}
    if format.kernel == DOT_MATMUL:
        isa = cpu_kernels.choose_isa("auto") if isa is None else isa
        attrs["isa"] = np.int32(isa[format.name])
    m = lhs.shape[0] if order is None else order.shape[0]
    order = jnp.zeros((0,), jnp.int32) if order is None else order.astype(jnp.int32)  # i32[0]: lhs as sorted
    out = jax.ShapeDtypeStruct((m, rhs.w[0].shape[1] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[format.kernel], out, vmap_method="sequential")(
        lhs.astype(jnp.float32), *ops, *ups, group_sizes.astype(jnp.int32), order, **attrs)


def grouped_matmul(lhs, rhs, group_sizes, native: bool = False, isa: cpu_kernels.DotIsa | None = None):
    """`jax.lax.ragged_dot`'s contract for ExpertStack experts: natively where `native`, else tiled
    (float experts beside them - a GGUF's projection of a shape without whole blocks - tiled too)."""
    if not isinstance(rhs, ExpertStack):
        return blocked_ragged_dot(lhs, rhs, group_sizes)
    if native:
        return native_grouped(lhs, rhs, group_sizes, isa=isa)
    return blocked_ragged_dot(lhs, rhs, group_sizes, product=_tile_product)


def grouped_gated(lhs, w_gate, w_up, group_sizes, order=None, native: bool = False,
                  isa: cpu_kernels.DotIsa | None = None):
    """silu(lhs @ Wg_e) * (lhs @ Wu_e) per expert group: one native call where `native`. With `order`
    (`grouped_experts`' native rows only): lhs is the unsorted tokens, read in sorted order by that
    call (`native_grouped`), or gathered first (native_gather) where the product is not one call."""
    if native and isinstance(w_gate, ExpertStack) and isinstance(w_up, ExpertStack) and type(w_gate.w) is type(w_up.w):
        return native_grouped(lhs, w_gate, group_sizes, up=w_up, isa=isa, order=order)
    if order is not None:
        lhs = native_gather(lhs, order)
    g = grouped_matmul(lhs, w_gate, group_sizes, native, isa)
    return jax.nn.silu(g) * grouped_matmul(lhs, w_up, group_sizes, native, isa)


def native_route(group, e: int):
    """(argsort(group, stable=True), rows per expert i32[e]) of group i32[M] (values e and past: no
    expert's, sorted last), natively."""
    shapes = (jax.ShapeDtypeStruct(group.shape, jnp.int32), jax.ShapeDtypeStruct((e,), jnp.int32))
    return jax.ffi.ffi_call("jaxserve_moe_route", shapes, vmap_method="sequential")(group.astype(jnp.int32))


def native_gather(x, order):
    """x[order // k] (order i32[T*k]: the expert-sorted rows' token-slot indices), natively."""
    out = jax.ShapeDtypeStruct((order.shape[0], x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_moe_gather", out, vmap_method="sequential")(
        x.astype(jnp.float32), order.astype(jnp.int32))


def native_combine(y, order, w):
    """einsum("tkh,tk->th", y[argsort(order)].reshape(T, k, H), w) bit for bit, natively."""
    out = jax.ShapeDtypeStruct((w.shape[0], y.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_moe_combine", out, vmap_method="sequential")(
        y.astype(jnp.float32), order.astype(jnp.int32), w.astype(jnp.float32))


def packed_moe(moe, native: bool, isa: cpu_kernels.DotIsa | None = None):
    """A backend's `ops.moe` (runtime/moe.py's signature) that also takes ExpertStack experts: their
    grouped products natively where `native` (the backend's `native_experts`: the native CPU kernels,
    also under tensor / expert parallelism, where the MoE runs per device under shard_map; and
    float32 rows), else tiled; float and MXFP4 experts go to `moe` as before."""

    def run(x, ids, weights, w_gate, w_up, w_down, num_rows=None, **kw):
        if not any(isinstance(w, ExpertStack) for w in (w_gate, w_up, w_down)):
            return moe(x, ids, weights, w_gate, w_up, w_down, num_rows, **kw)
        nat = native and x.dtype == jnp.float32
        # The rows moved natively where the down product is a native grouped call (its rows past the
        # groups', the routed-away slots', come out 0, as combine needs).
        native_rows = nat and isinstance(w_down, ExpertStack)
        return grouped_experts(x, ids, weights, w_gate, w_up, w_down, num_rows,
                               matmul=functools.partial(grouped_matmul, native=nat, isa=isa),
                               gated=functools.partial(grouped_gated, native=nat, isa=isa),
                               rows=(native_route, native_gather, native_combine) if native_rows else None, **kw)

    return run
