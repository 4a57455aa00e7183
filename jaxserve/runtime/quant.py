"""Linear weights that stay quantized in memory: int8 per output channel, GGUF's Q8_0 / Q4_0 /
Q4_1 blocks and Q4_K / Q6_K super-blocks (their codecs: runtime/kquants.py), made at load time
from float weights, or kept as a GGUF file stores them; and the two formats computed with the
CPU's dot-product instructions (csrc/dot_matmul.cc): bfloat16 weights (activations rounded to
bfloat16, float32 sums), W8A8 (int8 weights and per-row int8 activations in blocks of 32, int32
sums per block) and W4A8 (Q4_1's 4-bit blocks times the same int8 activations: llama.cpp's
Q4_1 x Q8_1; under it a GGUF's Q8_0 blocks run as Q8A8, Q8_0 x Q8_0).

Every format is a pytree NamedTuple laid out in the 64-column panels of the float32 packed
matmul (csrc/matmul.cc): a [K, N] kernel becomes [N / 64, K, 64] panels, each contiguous, with
blocks of 32 running along K (GGUF's blocks run along a row of the [out, in] matrix: the same K).
`linear` runs the native kernel (csrc/quant_matmul.cc, which decodes each weight in registers
just before its FMA) where the backend runs native linear layers; elsewhere it dequantizes inside
the computation, so no float copy of a weight is ever stored. `quantized_ops` hands the model
(through runtime/backend.py's ModelOps) ops that take these formats as well as float weights.

A tied embedding table [V, H] is held once as its LM head's panels ([H, V] kernel), as the float
packed path does; `embed` gathers and decodes token rows from them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import QUANTIZATIONS
from jaxserve.errors import UserError
from jaxserve.runtime import kquants
from jaxserve.runtime.kquants import Q4KWeight, Q6KWeight
from jaxserve.runtime.mxfp4 import Mxfp4Weight

PANEL = 64  # columns per panel (csrc/matmul.cc, csrc/quant_matmul.cc)
BLOCK = 32  # weights per GGUF block, along K
DOT_SCHEMES = ("bfloat16", "w8a8", "w4a8")  # csrc/dot_matmul.cc's formats
# what `quantize_params` makes
SCHEMES = tuple(q for q in QUANTIZATIONS if q != "gguf") + tuple(s for s in DOT_SCHEMES if s not in QUANTIZATIONS)


class Int8Weight(NamedTuple):
    """Symmetric int8 per output channel: W[k, n] = q[k, n] * scale[n]."""

    q: jax.Array  # i8[N / 64, K, 64], |q| <= 127
    scale: jax.Array  # f32[N]: max_k |W[k, n]| / 127


class Fp8Weight(NamedTuple):
    """float8_e4m3fn per output channel: W[k, n] = e4m3(q[k, n]) * scale[n]."""

    q: jax.Array  # u8[N / 64, K, 64]: float8_e4m3fn bits
    scale: jax.Array  # f32[N]


class Q8Weight(NamedTuple):
    """GGUF Q8_0: W[k, n] = q[k, n] * d[k / 32, n]."""

    q: jax.Array  # i8[N / 64, K, 64]
    d: jax.Array  # f16[N / 64, K / 32, 64]


class Q4Weight(NamedTuple):
    """GGUF Q4_1 (and Q4_0, with m = -8 d): W[k, n] = q[k, n] * d[k / 32, n] + m[k / 32, n],
    q in 0..15, two per byte along K: W[2j] in the low nibble, W[2j + 1] in the high one."""

    q: jax.Array  # u8[N / 64, K / 2, 64]
    d: jax.Array  # f16[N / 64, K / 32, 64]
    m: jax.Array  # f16[N / 64, K / 32, 64]


class Bf16Weight(NamedTuple):
    """bfloat16 weights in k pairs (what vdpbf16ps reads): q[p, i, 2 j + t] = W[2 i + t, 64 p + j].
    Products use x rounded to bfloat16; sums are float32."""

    q: jax.Array  # bf16[N / 64, K / 2, 128]


class W8A8Weight(NamedTuple):
    """Symmetric int8 per output channel (`quantize_int8`'s Q) in k quads, offset to unsigned (the
    operand of vpdpbusd that is): q[p, i, 4 j + t] = Q[4 i + t, 64 p + j] + 128, W = Q * scale.
    x is quantized to int8 in blocks of 32 along k when it is used (`quantize_blocks`); each
    block's int32 sum is scaled by its activation scale, and the total by scale[n]."""

    q: jax.Array  # u8[N / 64, K / 4, 256]
    scale: jax.Array  # f32[N]: max_k |W[k, n]| / 127


class W4A8Weight(NamedTuple):
    """Q4Weight's values (GGUF Q4_1; Q4_0 with m = -8 d) in k quads as W8A8Weight's, two quads a
    byte: q[p, g, 4 j + t] = Q[8 g + t, 64 p + j] | Q[8 g + 4 + t, 64 p + j] << 4, Q in 0..15,
    W = Q d + m per block of 32 along k. x is quantized as for W8A8; each block adds
    sx (d sum(xq Q) + m sum(xq))."""

    q: jax.Array  # u8[N / 64, K / 8, 256]
    d: jax.Array  # f16[N / 64, K / 32, 64]
    m: jax.Array  # f16[N / 64, K / 32, 64]


class Q8A8Weight(NamedTuple):
    """Q8Weight's values (GGUF Q8_0) in W8A8Weight's quads, + 128, with d and m = -128 d per block
    of 32 along k (W = q d + m): the W4A8 block arithmetic on whole bytes, for int8 activations."""

    q: jax.Array  # u8[N / 64, K / 4, 256]: Q + 128
    d: jax.Array  # f16[N / 64, K / 32, 64]
    m: jax.Array  # f16[N / 64, K / 32, 64]: -128 d (exact)


QuantWeight = (Int8Weight | Q8Weight | Q4Weight | Fp8Weight | Bf16Weight | W8A8Weight | W4A8Weight | Q8A8Weight
               | Q4KWeight | Q6KWeight)
_FMT = {Int8Weight: 0, Q8Weight: 1, Q4Weight: 2, Fp8Weight: 3, Q4KWeight: 4, Q6KWeight: 5}  # the `fmt` attribute of csrc/quant_matmul.cc
_DOT_FMT = {Bf16Weight: 0, W8A8Weight: 1, W4A8Weight: 2, Q8A8Weight: 3}  # ... of csrc/dot_matmul.cc
_DOT_NAME = {Bf16Weight: "bfloat16", W8A8Weight: "w8a8", W4A8Weight: "w4a8", Q8A8Weight: "q8a8"}  # cpu_kernels.dot_isa's
_PER_WORD = {Bf16Weight: 2, W8A8Weight: 4, Q8A8Weight: 4}  # k values interleaved per 32-bit lane
_BLOCKED = (W4A8Weight, Q8A8Weight)  # dot formats with d and m per block


def is_quantized(w) -> bool:
    return isinstance(w, (Int8Weight, Q8Weight, Q4Weight, Fp8Weight, Bf16Weight, W8A8Weight, W4A8Weight, Q8A8Weight,
                          Q4KWeight, Q6KWeight) + EXPERT_FORMATS)


# stacked-expert formats kept as stored, read by the MoE op itself (runtime/moe.py), not by linear
EXPERT_FORMATS = (Mxfp4Weight,)


def block_of(scheme: str) -> int:
    """Weights per block along K of a scheme or GGUF type name (what K must be a multiple of)."""
    return kquants.SUPER if scheme.upper() in kquants.FORMATS else BLOCK


def quantizable(shape, block: int = BLOCK) -> bool:
    """Whether a [K, N] kernel has a quantized layout: N in whole panels, K in whole blocks."""
    return len(shape) == 2 and shape[1] % PANEL == 0 and shape[0] % block == 0


# ---- layout (numpy, at load time; jnp inside the computation) ---------------------------------
def to_panels(a, xp=np):
    """[K, N, ...] -> [N / 64, K, 64, ...] (cpu_kernels.pack_kernel, for any dtype and library)."""
    k, n = a.shape[:2]
    return xp.moveaxis(a.reshape(k, n // PANEL, PANEL, *a.shape[2:]), 1, 0)


def from_panels(p, xp=np):
    """Inverse of `to_panels`."""
    panels, k = p.shape[:2]
    return xp.moveaxis(p, 0, 1).reshape(k, panels * PANEL, *p.shape[3:])


def to_words(p, per: int, xp=np):
    """Panels [P, K, 64] -> [P, K / per, 64 * per]: `per` consecutive k of a column side by side."""
    panels, k, c = p.shape
    return xp.swapaxes(p.reshape(panels, k // per, per, c), 2, 3).reshape(panels, k // per, c * per)


def from_words(p, per: int, xp=np):
    """Inverse of `to_words`."""
    panels, kw, cw = p.shape
    return xp.swapaxes(p.reshape(panels, kw, cw // per, per), 2, 3).reshape(panels, kw * per, cw // per)


def _nibbles(q4):
    """u8[P, K / 2, 64] -> u8[P, K, 64] values 0..15 (numpy or jnp)."""
    p, half, c = q4.shape
    return (q4[:, :, None, :] >> np.array([0, 4], np.uint8)[:, None] & 15).reshape(p, 2 * half, c)


def _per_block(s, xp=jnp):
    """[P, K / 32, 64] -> [P, K, 64]: each block's value on its 32 rows."""
    return xp.repeat(s.astype(xp.float32), BLOCK, axis=1)


def dequantize(w: QuantWeight) -> jax.Array:
    """The float32 [K, N] kernel a quantized weight stands for (inside a computation: XLA's path)."""
    if isinstance(w, Int8Weight):
        return from_panels(w.q.astype(jnp.float32), jnp) * w.scale
    if isinstance(w, Fp8Weight):
        return from_panels(_e4m3(w.q), jnp) * w.scale
    if isinstance(w, Q8Weight):
        return from_panels(w.q.astype(jnp.float32) * _per_block(w.d), jnp)
    if isinstance(w, Bf16Weight):
        return from_panels(from_words(w.q, 2, jnp).astype(jnp.float32), jnp)
    if isinstance(w, W8A8Weight):
        return from_panels(_w8a8_q(w.q).astype(jnp.float32), jnp) * w.scale
    if isinstance(w, _BLOCKED):
        q = _w4a8_q(w.q) if isinstance(w, W4A8Weight) else from_words(w.q, 4, jnp)
        return from_panels(q.astype(jnp.float32) * _per_block(w.d) + _per_block(w.m), jnp)
    if isinstance(w, (Q4KWeight, Q6KWeight)):
        return from_panels(kquants.decode(w, jnp), jnp)
    return from_panels(_nibbles(w.q).astype(jnp.float32) * _per_block(w.d) + _per_block(w.m), jnp)


def _e4m3(bits):
    """u8 float8_e4m3fn bits -> float32 (jnp, inside a computation)."""
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def quantize_fp8(w) -> Fp8Weight:
    """Float [K, N] -> float8_e4m3fn per output channel (scale max |W| / 448, round to nearest)."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return Fp8Weight(np.ascontiguousarray(to_panels(q)), scale)


def quantize_int8(w) -> Int8Weight:
    """Float [K, N] (N % 64 == 0) -> symmetric int8 per output channel, round to nearest."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return Int8Weight(np.ascontiguousarray(to_panels(q)), scale)


def quantize_bf16(w) -> Bf16Weight:
    """Float [K, N] -> bfloat16 (round to nearest even; exact for a bfloat16 checkpoint) in k pairs."""
    return Bf16Weight(np.ascontiguousarray(to_words(to_panels(np.asarray(w, jnp.bfloat16)), 2)))


def quantize_w8a8(w) -> W8A8Weight:
    """Float [K, N] -> `quantize_int8`'s values, + 128, in k quads."""
    qw = quantize_int8(w)
    return W8A8Weight(np.ascontiguousarray(to_words((qw.q.astype(np.int16) + 128).astype(np.uint8), 4)), qw.scale)


def _w8a8_q(q, xp=jnp):
    """W8A8Weight.q -> Q int32 [P, K, 64] (numpy or jnp)."""
    return from_words(q, 4, xp).astype(xp.int32) - 128


def to_w4a8(w: Q4Weight) -> W4A8Weight:
    """A Q4Weight's values and blocks, bit for bit, in W4A8Weight's layout."""
    words = to_words(_nibbles(np.asarray(w.q)), 4)  # [P, K / 4, 256] values 0..15
    return W4A8Weight(np.ascontiguousarray(words[:, 0::2] | words[:, 1::2] << 4), np.asarray(w.d), np.asarray(w.m))


def to_q8a8(w: Q8Weight) -> Q8A8Weight:
    """A Q8Weight's values and blocks, bit for bit, in Q8A8Weight's layout."""
    d = np.asarray(w.d)
    q = to_words((np.asarray(w.q).astype(np.int16) + 128).astype(np.uint8), 4)
    return Q8A8Weight(np.ascontiguousarray(q), d, (d * np.float16(-128)).astype(np.float16))


def _w4a8_q(q, xp=jnp):
    """W4A8Weight.q -> Q [P, K, 64] in 0..15 (numpy or jnp)."""
    p, g, c = q.shape
    quads = xp.stack([q & 15, q >> 4], axis=2).reshape(p, 2 * g, c)  # [P, K / 4, 256]
    return from_words(quads, 4, xp)


def quantize_blocks(x, xp=jnp):
    """x f32[M, K] -> (int8 values f32[M, K] in -127..127, scale f32[M, K / 32]): each block of 32
    along k symmetric, rint(x * 127 / max |x_block|), as csrc/dot_matmul.cc quantizes W8A8's
    activations (jnp or numpy)."""
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    amax = xp.max(xp.abs(xb), axis=2, keepdims=True)
    inv = xp.where(amax > 0, xp.float32(127) / xp.where(amax > 0, amax, 1), xp.float32(0)).astype(xp.float32)
    q = xp.clip(xp.round(xb * inv), -127, 127).reshape(m, k)
    return q, (amax[..., 0] / xp.float32(127)).astype(xp.float32)


# GGUF block layouts (ggml-common.h): bytes per block, and where d, m and the quants sit in it.
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def from_gguf(raw: np.ndarray, type_name: str) -> QuantWeight:
    """A GGUF tensor's raw bytes (N rows = output channels, bytes per row), type Q8_0, Q4_0 or
    Q4_1 (or Q4_K, Q6_K: kquants.from_gguf), -> its format here, for the [K, N] kernel (the
    transpose of the [N, K] file matrix). Values are bit for bit what `gguf.quants.dequantize` gives."""
    if type_name in kquants.FORMATS:
        return kquants.from_gguf(raw, type_name)
    bb = GGUF_BLOCK_BYTES[type_name]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, bb)  # [N, K / 32, bb]
    d = to_panels(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].T)
    if type_name == "Q8_0":
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, -1)
        return Q8Weight(np.ascontiguousarray(to_panels(q.T)), np.ascontiguousarray(d))
    start = 2 if type_name == "Q4_0" else 4
    m = (d * np.float16(-8) if type_name == "Q4_0"
         else to_panels(np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].T))
    qs = blocks[:, :, start:]  # [N, K / 32, 16]: element i low nibble, element i + 16 high
    vals = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, -1)  # [N, K] in 0..15
    q = to_panels(np.ascontiguousarray(vals.T))  # [P, K, 64]
    return Q4Weight(np.ascontiguousarray(q[:, 0::2] | q[:, 1::2] << 4), np.ascontiguousarray(d),
                    np.ascontiguousarray(m))


def quantize(w, scheme: str) -> QuantWeight:
    """Float [K, N] kernel -> `scheme`'s format: int8, or a GGUF block type quantized as llama.cpp
    does (`gguf.quants.quantize`)."""
    if scheme == "int8":
        return quantize_int8(w)
    if scheme == "fp8":
        return quantize_fp8(w)
    if scheme == "bfloat16":
        return quantize_bf16(w)
    if scheme == "w8a8":
        return quantize_w8a8(w)
    if scheme == "w4a8":
        return to_w4a8(quantize(w, "q4_1"))
    if scheme == "q8a8":  # what w4a8 makes of a GGUF's Q8_0 blocks (not a --quantization of its own)
        return to_q8a8(quantize(w, "q8_0"))
    if scheme.upper() in kquants.FORMATS:
        return kquants.from_gguf(kquants.quantize_gguf(np.asarray(w, np.float32).T, scheme.upper()), scheme.upper())
    import gguf

    raw = gguf.quants.quantize(np.ascontiguousarray(np.asarray(w, np.float32).T),
                               gguf.GGMLQuantizationType[scheme.upper()])
    return from_gguf(raw, scheme.upper())


# ---- the parameter tree -------------------------------------------------------------------------
def check_quantization(name: str, choices: tuple[str, ...] = QUANTIZATIONS) -> None:
    """A UserError naming `name` and the choices unless it is one of them."""
    if name not in choices:
        raise UserError(f"Unsupported quantization {name!r}: choose one of {', '.join(choices)} (gguf: a GGUF "
                        "file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks as stored; the others are made at load time; bfloat16, "
                        "w8a8 and w4a8 run on the CPU's dot-product instructions).",
                        param="quantization")


K_FALLBACK = {"q4_k": "q4_1", "q6_k": "q8_0"}  # quantize_params, for K not in super-blocks


def quantize_params(params: dict, scheme: str) -> dict:
    """Replace every linear "kernel" [K, N] (and the embedding table, held as its LM head's
    panels: see the module docstring) by `scheme`'s format; leaves whose shape has no quantized
    layout stay as they are. A K-quant scheme falls back, for a kernel whose K is not a multiple
    of 256, to a 32-block type of as many bits or more (q4_k -> q4_1, q6_k -> q8_0), as llama.cpp's
    quantizer falls back (to Q5_0 / Q8_0 there). Leaves already quantized (a GGUF's blocks) are
    kept (under w4a8, a Q4_0 / Q4_1 one in W4A8Weight's layout and a Q8_0 one in Q8A8Weight's, the
    same values). The float leaves
    are dropped: nothing here holds on to them."""
    check_quantization(scheme, SCHEMES)
    fallback = K_FALLBACK.get(scheme, scheme)

    def convert(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if isinstance(leaf, (Q4Weight, Q8Weight)) and scheme == "w4a8":
            return to_w4a8(leaf) if isinstance(leaf, Q4Weight) else to_q8a8(leaf)
        if is_quantized(leaf):
            return leaf
        on_device = isinstance(leaf, jax.Array)
        if names[-1] == "kernel":
            kernel = leaf
        elif names[-2:] == ["embed_tokens", "embedding"]:
            kernel = jax.ShapeDtypeStruct(leaf.shape[::-1], leaf.dtype) if isinstance(
                leaf, jax.ShapeDtypeStruct) else np.asarray(leaf).T
        else:
            return leaf
        kind = scheme if quantizable(kernel.shape, block_of(scheme)) else fallback
        if not quantizable(kernel.shape, block_of(kind)):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):  # lowering: only the shapes
            return abstract(kernel.shape, kind)
        w = quantize(kernel, kind)
        return type(w)(*map(jnp.asarray, w)) if on_device else w

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_quantized)


def abstract(shape, scheme: str) -> QuantWeight:
    """`scheme`'s format for a [K, N] kernel as ShapeDtypeStructs (jaxserve lower: no weights),
    from the layout of one block of 64 columns: parts grow with K along axis 1, with N along
    axis 0 (or along their one axis: per-channel scales)."""
    k, n = shape
    block = block_of(scheme)
    one = quantize(np.zeros((block, PANEL), np.float32), scheme)
    return type(one)(*(jax.ShapeDtypeStruct((n,) if a.ndim == 1 else (n // PANEL, a.shape[1] * k // block, *a.shape[2:]),
                                            a.dtype) for a in one))


def has_quantized(params) -> bool:
    return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def place_params(params: dict, dtype, shardings) -> dict:
    """Put a tree holding quantized weights on devices, laid out by `shardings` (a tree like it,
    mesh.quantized_shardings): float leaves cast to `dtype`, quantized ones as they are (their
    scales stay float32 / float16 whatever the compute dtype)."""
    def put(w, sharding):
        if isinstance(w, jax.ShapeDtypeStruct) or is_quantized(w) and isinstance(w[0], jax.ShapeDtypeStruct):
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype if is_quantized(w) else dtype,
                                                                  sharding=s), w, sharding)
        return jax.device_put(w if is_quantized(w) else np.asarray(w, jnp.dtype(dtype)), sharding)

    return jax.tree.map(put, params, shardings, is_leaf=is_quantized)


def weight_bytes(params) -> int:
    """Bytes of every array in the tree (quantized formats count their parts): what the weights
    hold in memory."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


# ---- the ops ------------------------------------------------------------------------------------
def _native(native: bool | None, x, *ws) -> bool:
    """Whether the native kernel runs this call: where the backend said so (None: where the library
    is built, on a CPU backend), for float32 x[M, K] and weights of one format."""
    if native is None:
        from jaxserve.runtime import cpu_kernels

        native = jax.default_backend() == "cpu" and cpu_kernels.available() is None
    return native and x.ndim == 2 and x.dtype == jnp.float32 and all(type(w) is type(ws[0]) for w in ws)


def _operands(w):
    """(q, scales, mins) as the native kernel takes them; a format without mins passes an empty one
    (K-quants: q, the super-blocks' f16 d, the sub-blocks' integer scales)."""
    if isinstance(w, (Q4KWeight, Q6KWeight)):
        return w.q, w.d, w.s
    return (w.q, w.scale, jnp.zeros((0,), jnp.float16)) if isinstance(w, (Int8Weight, Fp8Weight)) else (
        (w.q, w.d, jnp.zeros((0,), jnp.float16)) if isinstance(w, Q8Weight) else (w.q, w.d, w.m))


def _n(w) -> int:
    return w.q.shape[0] * PANEL


def _rows(x, num_rows):
    return jnp.reshape(jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32), (1,))


def linear(x, w, num_rows=None, native: bool | None = None):
    """x f32[M, K] @ W -> f32[M, N] for any weight format (a plain [K, N] array too). With
    `num_rows` (i32[1] or int: the step's real tokens) the native kernel computes only those rows
    and the rest come out zero; each row is summed in the same order whatever the batch. `native`:
    the backend's choice (see `_native`); elsewhere W is dequantized inside the computation."""
    if not is_quantized(w):
        return x @ w.astype(x.dtype)
    if type(w) in _DOT_FMT:
        return _dot(x, (w,), num_rows, native)
    if not _native(native, x, w):
        # in x's dtype (bfloat16 on accelerators), accumulated in float32
        return jnp.dot(x, dequantize(w).astype(x.dtype), preferred_element_type=jnp.float32)
    out = jax.ShapeDtypeStruct((x.shape[0], _n(w)), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_quant_matmul", out, vmap_method="sequential")(
        x, *_operands(w), _rows(x, num_rows), fmt=np.int32(_FMT[type(w)]))


def linear_gated(x, w_gate, w_up, num_rows=None, native: bool | None = None):
    """silu(x @ W_gate) * (x @ W_up), the gated MLP's first half, in one native call where both
    weights share a format (SiLU and the product applied to each tile as it is computed)."""
    if type(w_gate) in _DOT_FMT and type(w_up) is type(w_gate):
        return _dot(x, (w_gate, w_up), num_rows, native)
    if not (is_quantized(w_gate) and _native(native, x, w_gate, w_up)):
        return jax.nn.silu(linear(x, w_gate, num_rows, native)) * linear(x, w_up, num_rows, native)
    out = jax.ShapeDtypeStruct((x.shape[0], _n(w_gate)), jnp.float32)
    return jax.ffi.ffi_call("jaxserve_quant_matmul_gated", out, vmap_method="sequential")(
        x, *_operands(w_gate), *_operands(w_up), _rows(x, num_rows), fmt=np.int32(_FMT[type(w_gate)]))


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
    if isinstance(w, _BLOCKED):  # sx (d sum(xq Q) + m sum(xq)) per block
        return jnp.dot(xd, dequantize(w))
    return jnp.dot(xd, from_panels(_w8a8_q(w.q), jnp).astype(jnp.float32)) * w.scale


def _dot(x, ws, num_rows, native):
    """x @ W (one weight) or silu(x @ W_gate) * (x @ W_up) (two) for csrc/dot_matmul.cc's formats:
    natively, on the instructions cpu_kernels.dot_isa chooses, where the backend runs native
    linear layers; else `_dot_reference`."""
    if not _native(native, x, *ws):
        ys = [_dot_reference(x, w) for w in ws]
        return ys[0] if len(ws) == 1 else jax.nn.silu(ys[0]) * ys[1]
    from jaxserve.runtime import cpu_kernels

    w = ws[0]
    none16 = jnp.zeros((0,), jnp.float16)
    ops = [(v.q, jnp.zeros((0,), jnp.float32), none16) if isinstance(v, Bf16Weight) else
           (v.q, v.d, v.m) if isinstance(v, _BLOCKED) else (v.q, v.scale, none16) for v in ws]
    out = jax.ShapeDtypeStruct((x.shape[0], _n(w)), jnp.float32)
    name = "jaxserve_dot_matmul" if len(ws) == 1 else "jaxserve_dot_matmul_gated"
    return jax.ffi.ffi_call(name, out, vmap_method="sequential")(
        x, *(a for op in ops for a in op), _rows(x, num_rows), fmt=np.int32(_DOT_FMT[type(w)]),
        isa=np.int32(cpu_kernels.dot_isa(_DOT_NAME[type(w)])))


def embed(w, ids):
    """Rows `ids` (i32[T]) of the embedding table whose LM head is `w` ([H, V] panels: a
    quantized format, or float panels [V / 64, H, 64]) -> f32[T, H], decoded from the panels."""
    p, c = ids // PANEL, ids % PANEL
    if not is_quantized(w):
        return w[p, :, c]
    if isinstance(w, Int8Weight):
        return w.q[p, :, c].astype(jnp.float32) * w.scale[ids][:, None]
    if isinstance(w, Fp8Weight):
        return _e4m3(w.q[p, :, c]) * w.scale[ids][:, None]
    if isinstance(w, (Q4KWeight, Q6KWeight)):
        return kquants.decode(kquants.gather_rows(w, p, c), jnp)[:, :, 0]
    if type(w) in _PER_WORD or isinstance(w, W4A8Weight):  # words [T, K / per, 4 bytes] -> [T, K]
        b = w.q.reshape(*w.q.shape[:2], PANEL, w.q.shape[2] // PANEL)[p, :, c, :]
        if isinstance(w, W4A8Weight):  # a byte's low nibbles (one quad), then its high ones
            b = jnp.stack([b & 15, b >> 4], axis=2)
        q = b.reshape(ids.shape[0], -1).astype(jnp.float32)
        if isinstance(w, _BLOCKED):
            return q * jnp.repeat(w.d[p, :, c].astype(jnp.float32), BLOCK, axis=1) + jnp.repeat(
                w.m[p, :, c].astype(jnp.float32), BLOCK, axis=1)
        return (q - 128) * w.scale[ids][:, None] if isinstance(w, W8A8Weight) else q
    d = jnp.repeat(w.d[p, :, c].astype(jnp.float32), BLOCK, axis=1)  # [T, H]
    if isinstance(w, Q8Weight):
        return w.q[p, :, c].astype(jnp.float32) * d
    b = w.q[p, :, c]  # [T, H / 2]
    q = jnp.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(jnp.float32)
    return q * d + jnp.repeat(w.m[p, :, c].astype(jnp.float32), BLOCK, axis=1)


def quantized_ops(ops, native: bool):
    """A backend's `ModelOps` (runtime/backend.py) that also take weights in these formats: the
    native kernels where `native` (the backend's choice for the linear layers), else dequantized
    inside the computation; every other weight goes to `ops` as before."""

    def lin(x, w, num_rows=None):
        return linear(x, w, num_rows, native) if is_quantized(w) else ops.linear(x, w, num_rows)

    def gated(x, w_gate, w_up, num_rows=None):
        if is_quantized(w_gate) and type(w_gate) is type(w_up):
            return linear_gated(x, w_gate, w_up, num_rows, native)
        if is_quantized(w_gate) or is_quantized(w_up):  # formats differ (a GGUF may mix types)
            return jax.nn.silu(lin(x, w_gate, num_rows)) * lin(x, w_up, num_rows)
        return ops.gated(x, w_gate, w_up, num_rows)

    def lookup(table, ids):
        return embed(table, ids) if is_quantized(table) else ops.embed(table, ids)

    def lm_head(x, table, num_rows=None):
        return linear(x, table, num_rows, native) if is_quantized(table) else ops.lm_head(x, table, num_rows)

    return dataclasses.replace(ops, linear=lin, gated=gated, embed=lookup, lm_head=lm_head)
