"""The ops on linear weights that stay quantized in memory (the formats: runtime/weight_formats.py;
the parameter tree: runtime/quant_params.py). `linear` runs a format's native kernel
(csrc/quant_matmul.cc, which decodes each weight in registers just before its FMA, or
csrc/dot_matmul.cc on the CPU's dot-product instructions) where the backend runs native linear
layers; elsewhere it dequantizes inside the computation, so no float copy of a weight is ever
stored. `quantized_ops` hands the model (through runtime/backend.py's ModelOps) ops that take
these formats as well as float weights.

A tied embedding table [V, H] is held once as its LM head's panels ([H, V] kernel), as the float
packed path does; `embed` gathers and decodes token rows from them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime import cpu_kernels
from jaxserve.runtime.panels import BLOCK, PANEL, from_panels, from_words
from jaxserve.runtime.row_fusion import RowNorm, unfused
from jaxserve.runtime.weight_formats import (
    DOT_MATMUL,
    Bf16Weight,
    W8A8Weight,
    dequantize,
    format_of,
    is_quantized,
    quantize_blocks,
    w8a8_q,
)


def _native(native: bool | None, x, *ws) -> bool:
    """Whether the native kernel runs this call: where the backend said so (None: where the library
    is built, on a CPU backend), for float32 x[M, K] and weights of one format."""
    if native is None:
        native = jax.default_backend() == "cpu" and cpu_kernels.available() is None
    return native and x.ndim == 2 and x.dtype == jnp.float32 and all(type(w) is type(ws[0]) for w in ws)


def _is_dot(w) -> bool:
    format = format_of(w)
    return format is not None and format.kernel == DOT_MATMUL


def _n(w) -> int:
    return w.q.shape[0] * PANEL


def _rows(x, num_rows):
    return jnp.reshape(jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32), (1,))


def linear(x, w, num_rows=None, native: bool | None = None, isa: cpu_kernels.DotIsa | None = None,
           norm: RowNorm | None = None, residual=None):
    """x f32[M, K] @ W -> f32[M, N] for any weight format (a plain [K, N] array too). With
    `num_rows` (i32[1] or int: the step's real tokens) the native kernel computes only those rows
    and the rest come out zero; each row is summed in the same order whatever the batch. `native`:
    the backend's choice (see `_native`); elsewhere W is dequantized inside the computation. `isa`:
    the backend's choice of instructions for the dot-product formats (None: the best here, `auto`).
    `norm` and `residual` (runtime/row_fusion.py): x's rows normed first, the residual added to the
    product (rows past num_rows: the residual's); in the dot-product formats' native call, else XLA ops."""
    if _is_dot(w):
        return _dot(x, (w,), num_rows, native, isa, norm, residual)
    return unfused(_linear)(x, w, num_rows, native, isa, norm=norm, residual=residual)


def _linear(x, w, num_rows, native, isa):
    if not is_quantized(w):
        return x @ w.astype(x.dtype)
    if not _native(native, x, w):
        # in x's dtype (bfloat16 on accelerators), accumulated in float32
        return jnp.dot(x, dequantize(w).astype(x.dtype), preferred_element_type=jnp.float32)
    format = format_of(w)
    out = jax.ShapeDtypeStruct((x.shape[0], _n(w)), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_quant_matmul", out, vmap_method="sequential")(
        x, *format.operands(w), _rows(x, num_rows), *_no_fusion(), format=np.int32(format.id), eps=np.float32(0))


def linear_gated(x, w_gate, w_up, num_rows=None, native: bool | None = None,
                 isa: cpu_kernels.DotIsa | None = None, norm: RowNorm | None = None):
    """silu(x @ W_gate) * (x @ W_up), the gated MLP's first half, in one native call where both
    weights share a format (SiLU and the product applied to each tile as it is computed); `norm`
    as `linear`'s."""
    if _is_dot(w_gate) and type(w_up) is type(w_gate):
        return _dot(x, (w_gate, w_up), num_rows, native, isa, norm)
    return unfused(_linear_gated)(x, w_gate, w_up, num_rows, native, isa, norm=norm)


def _linear_gated(x, w_gate, w_up, num_rows, native, isa):
    if not (is_quantized(w_gate) and _native(native, x, w_gate, w_up)):
        return jax.nn.silu(linear(x, w_gate, num_rows, native, isa)) * linear(x, w_up, num_rows, native, isa)
    format = format_of(w_gate)
    out = jax.ShapeDtypeStruct((x.shape[0], _n(w_gate)), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_quant_matmul_gated", out, vmap_method="sequential")(
        x, *format.operands(w_gate), *format.operands(w_up), _rows(x, num_rows), *_no_fusion(),
        format=np.int32(format.id), eps=np.float32(0))


def _no_fusion():
    """A plain or gated native call's norm and residual operands when it fuses neither (empty)."""
    return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)


def _dot_reference(x, w):
    """What csrc/dot_matmul.cc computes, in XLA's ops (the xla backend, accelerators): bfloat16 x
    times the bfloat16 weights summed in float32; W8A8: int8 rows times int8 weights summed in
    blocks of 32 (xq * sx, in float32 here) times the int8 weights, then scale[n]; W4A8: xq * sx
    times the blocks' Q d + m."""
    if isinstance(w, Bf16Weight):
        return jnp.dot(x.astype(jnp.bfloat16), from_panels(from_words(w.q, 2, jnp), jnp),
                       preferred_element_type=jnp.float32)
    xq, sx = quantize_blocks(x.astype(jnp.float32))
    xd = xq * jnp.repeat(sx, BLOCK, axis=1)
    if not isinstance(w, W8A8Weight):  # blocked: sx (d sum(xq Q) + m sum(xq)) per block
        return jnp.dot(xd, dequantize(w))
    return jnp.dot(xd, from_panels(w8a8_q(w.q), jnp).astype(jnp.float32)) * w.scale


def _dot(x, ws, num_rows, native, isa, norm=None, residual=None):
    """x @ W (one weight) or silu(x @ W_gate) * (x @ W_up) (two) for csrc/dot_matmul.cc's formats,
    with `norm` and `residual` fused in: natively, on the instructions `isa` (cpu_kernels.choose_isa:
    the backend's choice) names, where the backend runs native linear layers; else `_dot_reference`
    and XLA ops."""
    if not _native(native, x, *ws) or (residual is not None and residual.dtype != jnp.float32):
        def reference(x):
            ys = [_dot_reference(x, w) for w in ws]
            return ys[0] if len(ws) == 1 else jax.nn.silu(ys[0]) * ys[1]

        return unfused(reference)(x, norm=norm, residual=residual)
    format = format_of(ws[0])
    isa = cpu_kernels.choose_isa("auto") if isa is None else isa
    out = jax.ShapeDtypeStruct((x.shape[0], _n(ws[0])), jnp.float32)
    name = "jaxserve_dot_matmul" if len(ws) == 1 else "jaxserve_dot_matmul_gated"
    empty = jnp.zeros((0,), jnp.float32)
    scale = empty if norm is None else norm.scale.astype(jnp.float32)
    return jax.ffi.ffi_call(name, out, vmap_method="sequential")(
        x, *(a for w in ws for a in format.operands(w)), _rows(x, num_rows), scale,
        empty if residual is None else residual, format=np.int32(format.id),
        eps=np.float32(0 if norm is None else norm.eps), isa=np.int32(isa[format.name]))


def embed(w, ids):
    """Rows `ids` (i32[T]) of the embedding table whose LM head is `w` ([H, V] panels: a
    quantized format, or float panels [V / 64, H, 64]) -> f32[T, H], decoded from the panels."""
    p, c = ids // PANEL, ids % PANEL
    if not is_quantized(w):
        return w[p, :, c]
    return format_of(w).embed_rows(w, p, c, ids)


def quantized_ops(ops, native: bool, isa: cpu_kernels.DotIsa | None = None):
    """A backend's `ModelOps` (runtime/backend.py) that also take weights in these formats: the
    native kernels where `native` (the backend's choice for the linear layers), on the instructions
    `isa` (its choice for the dot-product formats), else dequantized inside the computation; every
    other weight goes to `ops` as before."""

    def lin(x, w, num_rows=None, norm=None, residual=None):
        if is_quantized(w):
            return linear(x, w, num_rows, native, isa, norm, residual)
        return ops.linear(x, w, num_rows, norm=norm, residual=residual)

    def gated(x, w_gate, w_up, num_rows=None, norm=None):
        if is_quantized(w_gate) and type(w_gate) is type(w_up):
            return linear_gated(x, w_gate, w_up, num_rows, native, isa, norm)
        if is_quantized(w_gate) or is_quantized(w_up):  # formats differ (a GGUF may mix types)
            x = x if norm is None else norm(x)
            return jax.nn.silu(lin(x, w_gate, num_rows)) * lin(x, w_up, num_rows)
        return ops.gated(x, w_gate, w_up, num_rows, norm=norm)

    def lookup(table, ids):
        return embed(table, ids) if is_quantized(table) else ops.embed(table, ids)

    def lm_head(x, table, num_rows=None):
        return linear(x, table, num_rows, native, isa) if is_quantized(table) else ops.lm_head(x, table, num_rows)

    return dataclasses.replace(ops, linear=lin, gated=gated, embed=lookup, lm_head=lm_head)
