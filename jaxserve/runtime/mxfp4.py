"""MXFP4 (OCP microscaling FP4) weights kept packed, as gpt-oss checkpoints store their experts.

A block is 32 consecutive values along K (the input axis) of one output row: 16 bytes of e2m1
codes, two per byte (the low nibble the even value, the high nibble the odd one), and one uint8
E8M0 exponent e (the block's scale is 2^(e - 127)). HF's layout, kept as it is:
  blocks u8[E, N, K/32, 16], scales u8[E, N, K/32]   (E experts, N output rows)
that is 4.25 bits per weight. Nothing is ever stored dequantized: `expert(e)` decodes one
expert's [K, N] matrix inside the step, next to the matmul that reads it (runtime/moe.py's
blocked grouped matmul multiplies one tile of rows by one expert at a time), so a step holds at
most one expert's float copy per tile, transiently. e2m1 values times a power of two are exact in
float32 and bfloat16, so the decode itself is exact.

On the native CPU backend the experts are laid out again at load (`to_panels`, the same bytes: 4.25
bits a weight) as `Mxfp4Panels`, a weight format of runtime/weight_formats.py, and run in
csrc/quant_matmul.cc (kMXFP4: each code and exponent decoded in registers before its FMA, float32
activations; exact) through the grouped expert call of runtime/expert_matmul.py.

`--quantization mxfp4a8` lays the same codes and exponents out as `Mxfp4A8Weight` (W4A8's nibble
layout: 4.25 bits a weight still) for csrc/dot_matmul.cc's kMXFP4A8: 2 e2m1 is an integer in
-12..12, multiplied against the activations quantized to int8 per block of 32 (vpdpbusd, AMX-INT8
tiles, or portable code), the block's int32 sum scaled by 2^(e - 128) and the activations' block
scale in float32. The weights are read exactly; the activations' int8 rounding is the error (as
w8a8's and w4a8's): not exact, unlike `Mxfp4Panels`' float32 activations.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.panels import PANEL, nibbles, to_words

BLOCK = 32  # values per scale
# e2m1 codes 0..15: sign bit 3, exponent bits 2..1, mantissa bit 0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BITS_PER_WEIGHT = (BLOCK // 2 * 8 + 8) / BLOCK  # 4.25


class Mxfp4Weight(NamedTuple):
    """Stacked experts' [E, K, N] matrices as MXFP4 blocks along K (HF's gpt-oss layout)."""

    blocks: jax.Array  # u8[E, N, K/32, 16]
    scales: jax.Array  # u8[E, N, K/32]

    @property
    def shape(self) -> tuple[int, int, int]:
        """The float stack's shape [E, K, N] (what the model's matmuls see)."""
        e, n, g, _ = self.blocks.shape
        return (e, g * BLOCK, n)

    def expert(self, i, dtype=jnp.float32):
        """Expert i's [K, N] matrix, decoded (i may be traced)."""
        blocks = jax.lax.dynamic_index_in_dim(self.blocks, i, keepdims=False)
        scales = jax.lax.dynamic_index_in_dim(self.scales, i, keepdims=False)
        return decode(blocks, scales, dtype).T

    def dequantize(self, dtype=jnp.float32):
        """The whole [E, K, N] stack (tests and references only: the model never calls this)."""
        return jnp.swapaxes(decode(self.blocks, self.scales, dtype), -1, -2)


def decode(blocks, scales, dtype=jnp.float32):
    """u8[..., G, 16] codes and u8[..., G] exponents -> [..., G * 32] values (jnp, exact)."""
    lut = jnp.asarray(E2M1, jnp.float32)
    b = blocks.astype(jnp.int32)
    vals = jnp.stack([lut[b & 0xF], lut[b >> 4]], axis=-1).reshape(*b.shape[:-1], BLOCK)
    vals = jnp.ldexp(vals, scales.astype(jnp.int32)[..., None] - 127)
    return vals.reshape(*b.shape[:-2], -1).astype(dtype)


def decode_numpy(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The reference decode in numpy (float64): u8[..., G, 16], u8[..., G] -> [..., G * 32]."""
    lut = np.asarray(E2M1, np.float64)
    vals = np.stack([lut[blocks & 0xF], lut[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    vals = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def quantize(w: np.ndarray) -> Mxfp4Weight:
    """Float experts [E, K, N] -> MXFP4 (numpy, round to nearest e2m1 after scaling each block so
    its largest magnitude fits 6.0): how the tests make an MXFP4 model from a float one."""
    w = np.swapaxes(np.asarray(w, np.float64), -1, -2)  # [E, N, K]
    e, n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs K a multiple of {BLOCK}, not {k}")
    blk = w.reshape(e, n, k // BLOCK, BLOCK)
    amax = np.abs(blk).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).clip(-127, 127)
    scaled = blk / np.exp2(exp)[..., None]
    lut = np.asarray(E2M1[:8])
    codes = np.abs(np.abs(scaled)[..., None] - lut).argmin(axis=-1).astype(np.uint8)
    codes |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return Mxfp4Weight(np.ascontiguousarray(packed), np.ascontiguousarray(exp + 127, dtype=np.uint8))


def deinterleave_rows(w: Mxfp4Weight) -> tuple[Mxfp4Weight, Mxfp4Weight]:
    """gpt-oss's gate_up_proj holds gate and up as alternating output rows: the two halves (rows
    are independent blocks, so this is a slice of the packed data)."""
    return (Mxfp4Weight(w.blocks[:, 0::2], w.scales[:, 0::2]),
            Mxfp4Weight(w.blocks[:, 1::2], w.scales[:, 1::2]))


GGML_BLOCK_BYTES = 1 + BLOCK // 2  # ggml's block_mxfp4: the E8M0 exponent, then 16 bytes of codes


def from_ggml(raw: np.ndarray) -> Mxfp4Weight:
    """A GGUF's MXFP4 tensor (ggml type 39) as stored: u8[E, N, K/32 * 17], each block its exponent
    e (the same E8M0 byte: ggml's half-scale times its doubled e2m1 table is HF's 2^(e-127) times
    e2m1) and 16 bytes whose low nibbles are values 0..15 and high nibbles values 16..31 -> HF's
    layout (byte m: values 2m low, 2m+1 high). uint8 shuffles only, no float copy."""
    raw = np.asarray(raw, np.uint8)
    blk = raw.reshape(*raw.shape[:-1], raw.shape[-1] // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES)
    qs = blk[..., 1:]
    vals = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [..., 32] codes in value order
    blocks = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
    return Mxfp4Weight(np.ascontiguousarray(blocks), np.ascontiguousarray(blk[..., 0]))


def weight_bytes(w: Mxfp4Weight) -> int:
    return int(np.prod(w.blocks.shape)) + int(np.prod(w.scales.shape))


class Mxfp4Panels(NamedTuple):
    """One [K, N] matrix's MXFP4 blocks in the 64-column panels of runtime/panels.py (csrc/quant_matmul.cc
    kMXFP4): W[k, n] = e2m1(code[k, n]) * 2^(e[k / 32, n] - 127); codes two a byte along K as Q4Weight's
    (k = 2j the low nibble, 2j + 1 the high one)."""

    q: jax.Array  # u8[N / 64, K / 2, 64]
    e: jax.Array  # u8[N / 64, K / 32, 64]


def to_panels(blocks: np.ndarray, scales: np.ndarray) -> Mxfp4Panels:
    """One matrix of HF's layout (blocks u8[N, K/32, 16], scales u8[N, K/32]) in panels (numpy; bytes moved only)."""
    n = blocks.shape[0]
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(n, -1)  # [N, K]: k = 2j low nibble
    q = codes.T.reshape(-1, n // PANEL, PANEL).transpose(1, 0, 2)  # [P, K, 64]
    e = np.ascontiguousarray(scales).T.reshape(-1, n // PANEL, PANEL).transpose(1, 0, 2)
    return Mxfp4Panels(np.ascontiguousarray(q[:, 0::2] | q[:, 1::2] << 4), np.ascontiguousarray(e))


def stack_panels(w: Mxfp4Weight):
    """Stacked experts (Mxfp4Weight, numpy or device arrays) -> the (q, e) parts stacked [E, ...]."""
    blocks, scales = np.asarray(w.blocks), np.asarray(w.scales)
    per = [to_panels(blocks[i], scales[i]) for i in range(blocks.shape[0])]
    return Mxfp4Panels(np.stack([p.q for p in per]), np.stack([p.e for p in per]))


def panel_values(codes, e, axis: int = -2):
    """Codes [..., K, 64] in 0..15 and exponents [..., K / 32, 64] -> float32 values (jnp, exact);
    `axis`: K's (-1: rows [T, K] and [T, K / 32])."""
    lut = jnp.asarray(E2M1, jnp.float32)
    return jnp.ldexp(lut[codes.astype(jnp.int32)], jnp.repeat(e.astype(jnp.int32) - 127, BLOCK, axis=axis))


def row_values(b, e):
    """Rows of codes u8[T, K / 2] (two a byte) and exponents u8[T, K / 32] -> float32 [T, K] (jnp)."""
    return panel_values(jnp.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1), e, axis=-1)


def quantize_panels(w) -> Mxfp4Panels:
    """Float [K, N] -> MXFP4 in panels (`quantize`'s rounding): the registry's codec (tests, benches)."""
    hf = quantize(np.asarray(w, np.float32)[None])
    return to_panels(hf.blocks[0], hf.scales[0])


class Mxfp4A8Weight(NamedTuple):
    """Mxfp4Panels' codes in W4A8Weight's layout (weight_formats.py: k quads, two a byte) for
    csrc/dot_matmul.cc kMXFP4A8 (MXFP4 times int8 activations): q[p, g, 4 j + t] = c[8 g + t, 64 p + j]
    | c[8 g + 4 + t, 64 p + j] << 4, W = e2m1(c) * 2^(e - 127). Exact weights; activations rounded to
    int8 per block of 32 (not exact: Mxfp4Panels is the exact path)."""

    q: jax.Array  # u8[N / 64, K / 8, 256]
    e: jax.Array  # u8[N / 64, K / 32, 64]


def to_a8(w: Mxfp4Panels) -> Mxfp4A8Weight:
    """An Mxfp4Panels' codes and exponents, bit for bit, in Mxfp4A8Weight's layout (numpy)."""
    words = to_words(nibbles(np.asarray(w.q)), 4)  # [P, K / 4, 256] codes 0..15
    return Mxfp4A8Weight(np.ascontiguousarray(words[:, 0::2] | words[:, 1::2] << 4), np.asarray(w.e))


def stack_a8(w: Mxfp4Weight) -> Mxfp4A8Weight:
    """Stacked experts (HF's layout) -> Mxfp4A8Weight's parts stacked [E, ...] (numpy; bytes moved only)."""
    blocks, scales = np.asarray(w.blocks), np.asarray(w.scales)
    per = [to_a8(to_panels(blocks[i], scales[i])) for i in range(blocks.shape[0])]
    return Mxfp4A8Weight(np.stack([p.q for p in per]), np.stack([p.e for p in per]))
