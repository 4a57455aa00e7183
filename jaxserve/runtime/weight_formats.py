"""The weight formats linear layers keep in memory, one record each in `FORMATS`: int8 and fp8 per
output channel, GGUF's Q8_0 / Q4_0 / Q4_1 blocks and Q4_K / Q6_K super-blocks (runtime/kquants.py),
made at load time from float weights or kept as a GGUF file stores them; and the formats computed
with the CPU's dot-product instructions (csrc/dot_matmul.cc): bfloat16 weights (activations
rounded to bfloat16, float32 sums), W8A8 (int8 weights and per-row int8 activations in blocks of
32, int32 sums per block) and W4A8 (Q4_1's 4-bit blocks times the same int8 activations: llama.cpp's
Q4_1 x Q8_1; under it a GGUF's Q8_0 blocks run as Q8A8, Q8_0 x Q8_0), and MXFP4A8 (gpt-oss's MXFP4
experts as stored times the same int8 activations: runtime/mxfp4.py).

Every format is a pytree NamedTuple laid out in the 64-column panels of runtime/panels.py, with
blocks of 32 running along K (GGUF's blocks run along a row of the [out, in] matrix: the same K).
A record holds what the rest of the runtime asks of a format: its name (a `quantization` value,
what `quantize` makes and a key of `cpu_kernels.DotIsa`), the NamedTuple, the codec from
float weights, `dequantize` (inside the computation: no float copy of a weight is ever stored),
the rows an embedding lookup decodes, the operands its native kernel takes, and that kernel
(csrc/quant_matmul.cc or csrc/dot_matmul.cc) with its id there (the kernel's `format` attribute;
runtime/native_build.py generates the C++ table of them, formats.h, from these records).
A MoE layer's routed experts keep any of these formats stacked, as an `ExpertStack` (each part with
a leading expert axis; runtime/expert_matmul.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.runtime import kquants, mxfp4
from jaxserve.runtime.kquants import Q4KWeight, Q6KWeight
from jaxserve.runtime.mxfp4 import Mxfp4A8Weight, Mxfp4Panels, Mxfp4Weight
from jaxserve.runtime.panels import BLOCK, PANEL, from_panels, from_words, nibbles, to_panels, to_words

# GGUF block types a GGUF load keeps as stored (model/gguf_loader.py `keep_quantized`), each one of
# the formats below; the default weight format (default_format.py) reads it without importing gguf
GGUF_KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


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
               | Q4KWeight | Q6KWeight | Mxfp4Panels | Mxfp4A8Weight)


# ---- codecs: float [K, N] -> a format (numpy, at load time) ------------------------------------
def quantize_fp8(w) -> Fp8Weight:
    """Float [K, N] -> float8_e4m3fn per output channel (scale max |W| / 448, round to nearest)."""
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


def to_w4a8(w: Q4Weight) -> W4A8Weight:
    """A Q4Weight's values and blocks, bit for bit, in W4A8Weight's layout."""
    words = to_words(nibbles(np.asarray(w.q)), 4)  # [P, K / 4, 256] values 0..15
    return W4A8Weight(np.ascontiguousarray(words[:, 0::2] | words[:, 1::2] << 4), np.asarray(w.d), np.asarray(w.m))


def to_q8a8(w: Q8Weight) -> Q8A8Weight:
    """A Q8Weight's values and blocks, bit for bit, in Q8A8Weight's layout."""
    d = np.asarray(w.d)
    q = to_words((np.asarray(w.q).astype(np.int16) + 128).astype(np.uint8), 4)
    return Q8A8Weight(np.ascontiguousarray(q), d, (d * np.float16(-128)).astype(np.float16))


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


def _gguf_blocks(w, type_name: str) -> QuantWeight:
    """Float [K, N] -> a GGUF 32-block type quantized as llama.cpp does (`gguf.quants.quantize`)."""
    import gguf  # only for GGUF block types: not every image has it (tools/device_check checks startup)

    raw = gguf.quants.quantize(np.ascontiguousarray(np.asarray(w, np.float32).T),
                               gguf.GGMLQuantizationType[type_name])
    return from_gguf(raw, type_name)


def _k_quant(w, type_name: str) -> QuantWeight:
    return kquants.from_gguf(kquants.quantize_gguf(np.asarray(w, np.float32).T, type_name), type_name)


def quantize(w, quantization: str) -> QuantWeight:
    """Float [K, N] kernel -> the format of `quantization` (a format's name): its record's codec,
    or a GGUF block type quantized as llama.cpp does (`gguf.quants.quantize`)."""
    format = _BY_NAME.get(quantization)
    if format is not None:
        return format.quantize(w)
    if quantization.upper() in kquants.FORMATS:
        return _k_quant(w, quantization.upper())
    return _gguf_blocks(w, quantization.upper())


def quantize_blocks(x, xp=jnp):
    """x f32[M, K] -> (int8 values f32[M, K] in -127..127, scale f32[M, K / 32]): each block of 32
    along k symmetric, rint(x * 127 / max |x_block|), as csrc/dot_matmul.cc quantizes W8A8's
    activations (csrc/dot_acts.h) (jnp or numpy)."""
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    amax = xp.max(xp.abs(xb), axis=2, keepdims=True)
    inv = xp.where(amax > 0, xp.float32(127) / xp.where(amax > 0, amax, 1), xp.float32(0)).astype(xp.float32)
    q = xp.clip(xp.round(xb * inv), -127, 127).reshape(m, k)
    return q, (amax[..., 0] / xp.float32(127)).astype(xp.float32)


# ---- decoding inside the computation (jnp) -------------------------------------------------------
def e4m3(bits):
    """u8 float8_e4m3fn bits -> float32 (jnp, inside a computation)."""
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def w8a8_q(q, xp=jnp):
    """W8A8Weight.q -> Q int32 [P, K, 64] (numpy or jnp)."""
    return from_words(q, 4, xp).astype(xp.int32) - 128


def w4a8_q(q, xp=jnp):
    """W4A8Weight.q -> Q [P, K, 64] in 0..15 (numpy or jnp)."""
    p, g, c = q.shape
    quads = xp.stack([q & 15, q >> 4], axis=2).reshape(p, 2 * g, c)  # [P, K / 4, 256]
    return from_words(quads, 4, xp)


def _per_block(s, xp=jnp):
    """[P, K / 32, 64] -> [P, K, 64]: each block's value on its 32 rows."""
    return xp.repeat(s.astype(xp.float32), BLOCK, axis=1)


def _blocked(q, w):
    """[K, N] from values Q [P, K, 64] and per-block d and m: Q d + m."""
    return from_panels(q.astype(jnp.float32) * _per_block(w.d) + _per_block(w.m), jnp)


# an embedding lookup: rows ids (i32[T]) at panel p = ids / 64, column c = ids % 64 -> f32[T, H]
def _row_blocks(s, p, c):
    """Per-block values [P, K / 32, 64] of rows (p, c) -> f32[T, K]."""
    return jnp.repeat(s[p, :, c].astype(jnp.float32), BLOCK, axis=1)


def _word_rows(w, p, c, ids, halves: bool = False):
    """Rows of a words layout [P, K / per, 64 * per] -> f32[T, K] (W4A8: a byte's low nibbles,
    one quad, then its high ones)."""
    b = w.q.reshape(*w.q.shape[:2], PANEL, w.q.shape[2] // PANEL)[p, :, c, :]
    if halves:
        b = jnp.stack([b & 15, b >> 4], axis=2)
    return b.reshape(ids.shape[0], -1).astype(jnp.float32)


def _q4_rows(w, p, c, ids):
    b = w.q[p, :, c]  # [T, H / 2]
    q = jnp.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(jnp.float32)
    return q * _row_blocks(w.d, p, c) + _row_blocks(w.m, p, c)


# ---- the registry -------------------------------------------------------------------------------
QUANT_MATMUL, DOT_MATMUL = "quant_matmul", "dot_matmul"  # csrc/quant_matmul.cc, csrc/dot_matmul.cc
NATIVE_KERNELS = (QUANT_MATMUL, DOT_MATMUL)  # each numbers its formats 0, 1, ... (native_build.formats_header)


def _none(dtype):
    return jnp.zeros((0,), dtype)  # an operand a format does not have


@dataclass(frozen=True)
class WeightFormat:
    name: str  # the `quantization` value `quantize` makes it from (and a dot format's key in cpu_kernels.DotIsa)
    type: type  # its NamedTuple
    quantize: Callable  # float [K, N] -> the format (numpy)
    dequantize: Callable  # the format -> f32[K, N] (jnp)
    embed_rows: Callable  # (w, p, c, ids) -> f32[T, K]: rows of the table whose LM head it is
    operands: Callable  # the format -> (q, scales, mins), as its native kernel takes them
    kernel: str  # QUANT_MATMUL or DOT_MATMUL
    id: int  # the kernel's `format` attribute: its enumerator in the generated csrc/formats.h (native_build)


FORMATS = (
    WeightFormat("int8", Int8Weight, quantize_int8,
                 lambda w: from_panels(w.q.astype(jnp.float32), jnp) * w.scale,
                 lambda w, p, c, ids: w.q[p, :, c].astype(jnp.float32) * w.scale[ids][:, None],
                 lambda w: (w.q, w.scale, _none(jnp.float16)), QUANT_MATMUL, 0),
    WeightFormat("q8_0", Q8Weight, lambda w: _gguf_blocks(w, "Q8_0"),
                 lambda w: from_panels(w.q.astype(jnp.float32) * _per_block(w.d), jnp),
                 lambda w, p, c, ids: w.q[p, :, c].astype(jnp.float32) * _row_blocks(w.d, p, c),
                 lambda w: (w.q, w.d, _none(jnp.float16)), QUANT_MATMUL, 1),
    WeightFormat("q4_1", Q4Weight, lambda w: _gguf_blocks(w, "Q4_1"),
                 lambda w: _blocked(nibbles(w.q), w), _q4_rows,
                 lambda w: (w.q, w.d, w.m), QUANT_MATMUL, 2),
    WeightFormat("fp8", Fp8Weight, quantize_fp8,
                 lambda w: from_panels(e4m3(w.q), jnp) * w.scale,
                 lambda w, p, c, ids: e4m3(w.q[p, :, c]) * w.scale[ids][:, None],
                 lambda w: (w.q, w.scale, _none(jnp.float16)), QUANT_MATMUL, 3),
    *(WeightFormat(t.lower(), cls, lambda w, t=t: _k_quant(w, t),
                   lambda w: from_panels(kquants.decode(w, jnp), jnp),
                   lambda w, p, c, ids: kquants.decode(kquants.gather_rows(w, p, c), jnp)[:, :, 0],
                   lambda w: (w.q, w.d, w.s), QUANT_MATMUL, i)
      for i, (t, cls) in enumerate(kquants.FORMATS.items(), start=4)),
    # gpt-oss's MXFP4 experts (runtime/mxfp4.py), laid out in panels on the native CPU backend
    WeightFormat("mxfp4", Mxfp4Panels,
                 mxfp4.quantize_panels,
                 lambda w: from_panels(mxfp4.panel_values(nibbles(w.q), w.e), jnp),
                 lambda w, p, c, ids: mxfp4.row_values(w.q[p, :, c], w.e[p, :, c]),
                 lambda w: (w.q, w.e, _none(jnp.float16)), QUANT_MATMUL, 6),
    WeightFormat("bfloat16", Bf16Weight, quantize_bf16,
                 lambda w: from_panels(from_words(w.q, 2, jnp).astype(jnp.float32), jnp), _word_rows,
                 lambda w: (w.q, _none(jnp.float32), _none(jnp.float16)), DOT_MATMUL, 0),
    WeightFormat("w8a8", W8A8Weight, quantize_w8a8,
                 lambda w: from_panels(w8a8_q(w.q).astype(jnp.float32), jnp) * w.scale,
                 lambda w, p, c, ids: (_word_rows(w, p, c, ids) - 128) * w.scale[ids][:, None],
                 lambda w: (w.q, w.scale, _none(jnp.float16)), DOT_MATMUL, 1),
    WeightFormat("w4a8", W4A8Weight, lambda w: to_w4a8(quantize(w, "q4_1")),
                 lambda w: _blocked(w4a8_q(w.q), w),
                 lambda w, p, c, ids: _word_rows(w, p, c, ids, True) * _row_blocks(w.d, p, c) + _row_blocks(w.m, p, c),
                 lambda w: (w.q, w.d, w.m), DOT_MATMUL, 2),
    # what w4a8 makes of a GGUF's Q8_0 blocks (not a --quantization of its own)
    WeightFormat("q8a8", Q8A8Weight, lambda w: to_q8a8(quantize(w, "q8_0")),
                 lambda w: _blocked(from_words(w.q, 4, jnp), w),
                 lambda w, p, c, ids: _word_rows(w, p, c, ids) * _row_blocks(w.d, p, c) + _row_blocks(w.m, p, c),
                 lambda w: (w.q, w.d, w.m), DOT_MATMUL, 3),
    # MXFP4's codes times int8 activations (runtime/mxfp4.py): what mxfp4a8 makes of MXFP4 experts
    WeightFormat("mxfp4a8", Mxfp4A8Weight, lambda w: mxfp4.to_a8(mxfp4.quantize_panels(w)),
                 lambda w: from_panels(mxfp4.panel_values(w4a8_q(w.q), w.e), jnp),
                 lambda w, p, c, ids: mxfp4.panel_values(_word_rows(w, p, c, ids, True), w.e[p, :, c], axis=-1),
                 lambda w: (w.q, w.e, _none(jnp.float16)), DOT_MATMUL, 4),
)
_BY_TYPE = {f.type: f for f in FORMATS}
_BY_NAME = {f.name: f for f in FORMATS}
DOT_QUANTIZATIONS = tuple(f.name for f in FORMATS if f.kernel == DOT_MATMUL and f.name != "q8a8")


def format_of(w) -> WeightFormat | None:
    """The record of a weight's format, None for a float array (or anything else)."""
    return _BY_TYPE.get(type(w))


class ExpertStack(NamedTuple):
    """A mixture-of-experts layer's E routed experts' [K, N] kernels in one of the formats above,
    kept as stored: `w` is the format's NamedTuple with a leading axis of E on each part (expert e's
    parts are each part's e-th slice; runtime/expert_matmul.py multiplies them where they lie)."""

    w: QuantWeight

    @property
    def shape(self) -> tuple[int, int, int]:
        """The float stack's shape [E, K, N] (what the model's matmuls see)."""
        return (self.w[0].shape[0], *jax.eval_shape(lambda w: dequantize(expert_at(w, 0)), self.w).shape)

    def expert(self, i, dtype=jnp.float32):
        """Expert i's [K, N] matrix, decoded (i may be traced)."""
        return dequantize(expert_at(self.w, i)).astype(dtype)


def expert_at(w: QuantWeight, i) -> QuantWeight:
    """Expert i's weight of a format's NamedTuple of stacked parts (i may be traced)."""
    return type(w)(*(jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in w))


def stack_experts(ws: list) -> ExpertStack:
    """Per-expert weights of one format (numpy) -> their ExpertStack."""
    return ExpertStack(type(ws[0])(*(np.ascontiguousarray(np.stack(parts)) for parts in zip(*ws))))


# stacked-expert formats kept as stored, read by the MoE op itself (runtime/moe.py), not by linear
EXPERT_FORMATS = (Mxfp4Weight, ExpertStack)


def is_quantized(w) -> bool:
    return type(w) in _BY_TYPE or isinstance(w, EXPERT_FORMATS)


def dequantize(w: QuantWeight) -> jax.Array:
    """The float32 [K, N] kernel a quantized weight stands for (inside a computation: XLA's path)."""
    return _BY_TYPE[type(w)].dequantize(w)


def block_of(quantization: str) -> int:
    """Weights per block along K of a quantization or GGUF type name (what K must be a multiple of)."""
    return kquants.SUPER if quantization.upper() in kquants.FORMATS else BLOCK


def quantizable(shape, block: int = BLOCK) -> bool:
    """Whether a [K, N] kernel has a quantized layout: N in whole panels, K in whole blocks."""
    return len(shape) == 2 and shape[1] % PANEL == 0 and shape[0] % block == 0
