"""The parameter tree with quantized weights: every linear kernel (and a tied embedding table, held
once as its LM head's [H, V] panels, as the float packed path does; and a MoE layer's stacked routed
experts, as an ExpertStack of per-expert kernels) replaced by a format of runtime/weight_formats.py
at load time, or as shapes only for lowering; placed on devices; and measured."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import QUANTIZATIONS
from jaxserve.errors import UserError
from jaxserve.runtime import mxfp4
from jaxserve.runtime.panels import PANEL
from jaxserve.runtime.weight_formats import (
    DOT_QUANTIZATIONS,
    ExpertStack,
    Q4Weight,
    Q8Weight,
    QuantWeight,
    block_of,
    is_quantized,
    quantizable,
    quantize,
    stack_experts,
    to_q8a8,
    to_w4a8,
)

# the quantizations `quantize_params` makes
LOAD_QUANTIZATIONS = (tuple(q for q in QUANTIZATIONS if q != "gguf")
                      + tuple(q for q in DOT_QUANTIZATIONS if q not in QUANTIZATIONS))


def check_quantization(name: str, choices: tuple[str, ...] = QUANTIZATIONS) -> None:
    """A UserError naming `name` and the choices unless it is one of them."""
    if name not in choices:
        raise UserError(f"Unsupported quantization {name!r}: choose one of {', '.join(choices)} (gguf: a GGUF "
                        "file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks as stored; the others are made at load time; bfloat16, "
                        "w8a8, w4a8 and mxfp4a8 run on the CPU's dot-product instructions).",
                        param="quantization")


K_FALLBACK = {"q4_k": "q4_1", "q6_k": "q8_0"}  # quantize_params, for K not in super-blocks


def packs(path) -> bool:
    """Whether the parameter at `path` (its keys) is one a weight format replaces: a linear layer's
    kernel, or the embedding table (held as its LM head's panels)."""
    return path[-1] == "kernel" or tuple(path[-2:]) == ("embed_tokens", "embedding")


def quantize_params(params: dict, quantization: str, experts: bool = True) -> dict:
    """Replace every linear "kernel" [K, N] (and the embedding table, held as its LM head's
    panels: see the module docstring) by `quantization`'s format; leaves whose shape has no quantized
    layout stay as they are. A K-quant quantization falls back, for a kernel whose K is not a multiple
    of 256, to a 32-block type of as many bits or more (q4_k -> q4_1, q6_k -> q8_0), as llama.cpp's
    quantizer falls back (to Q5_0 / Q8_0 there). Leaves already quantized (a GGUF's blocks) are
    kept (under w4a8, a Q4_0 / Q4_1 one in W4A8Weight's layout and a Q8_0 one in Q8A8Weight's, the
    same values). Stacked routed experts (experts/{gate,up,down}_proj [E, K, N]) become an ExpertStack
    of each expert's kernel in the format (runtime/expert_matmul.py multiplies them as stored; under
    tensor or expert parallelism sharded as stored: model/sharding.py), unless not `experts` (they
    stay float). The float leaves are
    dropped: nothing here holds on to them."""
    check_quantization(quantization, LOAD_QUANTIZATIONS)
    if quantization == "mxfp4a8":
        return _mxfp4a8(params, experts)
    fallback = K_FALLBACK.get(quantization, quantization)

    def convert(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if isinstance(leaf, (Q4Weight, Q8Weight)) and quantization == "w4a8":
            return to_w4a8(leaf) if isinstance(leaf, Q4Weight) else to_q8a8(leaf)
        if isinstance(leaf, ExpertStack) and isinstance(leaf.w, (Q4Weight, Q8Weight)) and quantization == "w4a8":
            return stack_experts([convert(path, w) for w in _unstack(leaf)])
        if is_quantized(leaf):
            return leaf
        on_device = isinstance(leaf, jax.Array)
        if len(names) >= 2 and names[-2] == "experts" and names[-1] in EXPERT_KERNELS:
            return _experts(leaf, quantization, fallback, on_device) if experts else leaf
        if not packs(names):
            return leaf
        if names[-1] == "kernel":
            kernel = leaf
        else:  # the embedding table, as its LM head's [H, V]
            kernel = jax.ShapeDtypeStruct(leaf.shape[::-1], leaf.dtype) if isinstance(
                leaf, jax.ShapeDtypeStruct) else np.asarray(leaf).T
        kind = quantization if quantizable(kernel.shape, block_of(quantization)) else fallback
        if not quantizable(kernel.shape, block_of(kind)):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):  # lowering: only the shapes
            return abstract(kernel.shape, kind)
        w = quantize(kernel, kind)
        return type(w)(*map(jnp.asarray, w)) if on_device else w

    # the leaves convert on the CPU's cores (numpy's work on large arrays runs without the GIL)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = jax.tree_util.tree_map_with_path(lambda p, leaf: pool.submit(convert, p, leaf), params,
                                                   is_leaf=is_quantized)
        return jax.tree_util.tree_map(Future.result, futures, is_leaf=lambda x: isinstance(x, Future))


def _mxfp4a8(params: dict, experts: bool) -> dict:
    """--quantization mxfp4a8: every MXFP4 expert stack (mxfp4.Mxfp4Weight, a gpt-oss checkpoint's) as
    an ExpertStack of mxfp4.Mxfp4A8Weight, the same codes and exponents (int8 activations on the
    dot-product instructions); every other leaf as it is. A UserError where there are none, or where
    not `experts` (model/sharding.py refuses them split on their intermediate axis: EP keeps them whole)."""
    found = []

    def convert(leaf):
        if not isinstance(leaf, mxfp4.Mxfp4Weight) or leaf.shape[2] % PANEL:
            return leaf
        found.append(leaf)
        if isinstance(leaf.blocks, jax.ShapeDtypeStruct):  # lowering: only the shapes
            e, n, g, _ = leaf.blocks.shape
            return ExpertStack(mxfp4.Mxfp4A8Weight(jax.ShapeDtypeStruct((e, n // PANEL, 4 * g, 4 * PANEL), jnp.uint8),
                                                   jax.ShapeDtypeStruct((e, n // PANEL, g, PANEL), jnp.uint8)))
        stack = mxfp4.stack_a8(leaf)
        return ExpertStack(type(stack)(*map(jnp.asarray, stack)) if isinstance(leaf.blocks, jax.Array) else stack)

    if not experts:
        raise UserError("--quantization mxfp4a8 runs MXFP4 experts whole on one device: use tensor_parallel_size 1 "
                        "(or no --quantization: MXFP4 experts with float32 activations).", param="quantization")
    out = jax.tree.map(convert, params, is_leaf=lambda x: isinstance(x, mxfp4.Mxfp4Weight))
    if not found:
        raise UserError("--quantization mxfp4a8 applies to a checkpoint's MXFP4 experts (gpt-oss) whose width is a "
                        "multiple of 64; this model has none (w4a8 makes 4-bit blocks from float weights).",
                        param="quantization")
    return out


EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")  # a MoE layer's stacked routed experts [E, K, N]


def _unstack(stack: ExpertStack) -> list[QuantWeight]:
    return [type(stack.w)(*(np.asarray(a[e]) for a in stack.w)) for e in range(stack.w[0].shape[0])]


def _experts(leaf, quantization: str, fallback: str, on_device: bool):
    """Stacked float experts [E, K, N] -> an ExpertStack of `quantization`'s format (its fallback for
    a K not in its blocks; unchanged where neither fits)."""
    e, k, n = leaf.shape
    kind = quantization if quantizable((k, n), block_of(quantization)) else fallback
    if not quantizable((k, n), block_of(kind)):
        return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):  # lowering: only the shapes
        one = abstract((k, n), kind)
        return ExpertStack(type(one)(*(jax.ShapeDtypeStruct((e, *a.shape), a.dtype) for a in one)))
    w = np.asarray(leaf, np.float32)
    stack = stack_experts([quantize(w[i], kind) for i in range(e)])
    return ExpertStack(type(stack.w)(*map(jnp.asarray, stack.w))) if on_device else stack


def abstract(shape, quantization: str) -> QuantWeight:
    """`quantization`'s format for a [K, N] kernel as ShapeDtypeStructs (jaxserve lower: no weights),
    from the layout of one block of 64 columns: parts grow with K along axis 1, with N along
    axis 0 (or along their one axis: per-channel scales)."""
    k, n = shape
    block = block_of(quantization)
    one = quantize(np.zeros((block, PANEL), np.float32), quantization)
    return type(one)(*(jax.ShapeDtypeStruct((n,) if a.ndim == 1
                                            else (n // PANEL, a.shape[1] * k // block, *a.shape[2:]),
                                            a.dtype) for a in one))


def has_quantized(params) -> bool:
    return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def place_params(params: dict, dtype, shardings) -> dict:
    """Put a tree holding quantized weights on devices, laid out by `shardings` (a tree like it,
    model.sharding.quantized_shardings): float leaves cast to `dtype`, quantized ones as they are (their
    scales stay float32 / float16 whatever the compute dtype)."""
    def put(w, sharding):
        if isinstance(w, jax.ShapeDtypeStruct) or is_quantized(w) and isinstance(jax.tree.leaves(w)[0],
                                                                                 jax.ShapeDtypeStruct):
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype if is_quantized(w) else dtype,
                                                                  sharding=s), w, sharding)
        return jax.device_put(w if is_quantized(w) else np.asarray(w, jnp.dtype(dtype)), sharding)

    return jax.tree.map(put, params, shardings, is_leaf=is_quantized)


def weight_bytes(params) -> int:
    """Bytes of every array in the tree (quantized formats count their parts): what the weights
    hold in memory."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
