"""GGUF's K-quants Q4_K and Q6_K kept packed: super-blocks of 256 weights along K, their layout in
the 64-column panels of runtime/panels.py, read from a GGUF file's bytes, made from float weights,
and decoded (numpy or jnp, inside the computation: no float copy is stored).

  Q4_K  W = q * (d * sc) - dmin * m       q 4 bits; per 32 weights a 6-bit scale sc and min m;
                                          per 256 an f16 d and dmin           (4.625 bits/weight)
  Q6_K  W = (q - 32) * (d * sc)           q 6 bits (4 low + 2 high); per 16 weights an int8 sc;
                                          per 256 an f16 d                    (6.5625 bits/weight)

Why the decode is exact whatever the order of operations: d * sc (11 + 7 bits) and q times it
(at most 24 bits) are exact in float32, so each weight is rounded once at most (Q4_K's minus),
as `gguf.quants.dequantize` computes it; csrc/quant_matmul.cc decodes the same way (csrc/quant_decode.h).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxserve.runtime.panels import to_panels

SUPER = 256  # weights per super-block, along K
GGUF_BYTES = {"Q4_K": 144, "Q6_K": 210}  # bytes per super-block in a GGUF file (ggml-common.h)


class Q4KWeight(NamedTuple):
    """GGUF Q4_K in panels: q as Q4Weight's (k = 2j low nibble, 2j + 1 high)."""

    q: jax.Array  # u8[N / 64, K / 2, 64]
    s: jax.Array  # u8[N / 64, K / 32, 2, 64]: each 32-block's (sc, m), 0..63
    d: jax.Array  # f16[N / 64, K / 256, 2, 64]: each super-block's (d, dmin)


class Q6KWeight(NamedTuple):
    """GGUF Q6_K in panels; per super-block, 192 rows of 64 columns: rows 0..127 the low 4 bits
    (k = 2j low nibble, 2j + 1 high), rows 128..191 the high 2 bits (k = 4j + t in bits 2t, 2t + 1)."""

    q: jax.Array  # u8[N / 64, K / 256, 192, 64]
    s: jax.Array  # i8[N / 64, K / 16, 64]: each 16-block's scale
    d: jax.Array  # f16[N / 64, K / 256, 64]


KQuantWeight = Q4KWeight | Q6KWeight
FORMATS = {"Q4_K": Q4KWeight, "Q6_K": Q6KWeight}


def _to_panels(a):
    """[K, N, ...] -> [N / 64, K, 64, ...] (panels.to_panels, contiguous)."""
    return np.ascontiguousarray(to_panels(np.ascontiguousarray(a)))


# ---- decode: [P, ..., C] parts -> f32[P, K, C] (C = 64 for panels, 1 for gathered rows) --------
def decode(w: KQuantWeight, xp) -> jax.Array:
    """The float32 values of `w`'s panels, [P, K, C] (numpy or jnp)."""
    f32 = xp.float32
    if isinstance(w, Q4KWeight):
        p, half, c = w.q.shape
        nib = xp.stack([w.q & 15, w.q >> 4], axis=2).reshape(p, 2 * half, c).astype(f32)
        sup = xp.repeat(w.d.astype(f32), SUPER // 32, axis=1)  # [P, K / 32, 2, C]
        s = w.s.astype(f32)
        scale, mn = sup[:, :, 0] * s[:, :, 0], sup[:, :, 1] * s[:, :, 1]
        return nib * xp.repeat(scale, 32, axis=1) - xp.repeat(mn, 32, axis=1)
    p, nsup, _, c = w.q.shape
    lo, hi = w.q[:, :, :128], w.q[:, :, 128:]
    lo = xp.stack([lo & 15, lo >> 4], axis=3).reshape(p, nsup, SUPER, c)
    hi = xp.stack([(hi >> s) & 3 for s in (0, 2, 4, 6)], axis=3).reshape(p, nsup, SUPER, c)
    q = (lo | hi << 4).astype(xp.int32).reshape(p, nsup * SUPER, c) - 32
    scale = xp.repeat(w.d.astype(f32), SUPER // 16, axis=1) * w.s.astype(f32)  # [P, K / 16, C]
    return q.astype(f32) * xp.repeat(scale, 16, axis=1)


def gather_rows(w: KQuantWeight, p, c) -> KQuantWeight:
    """Columns c of panels p (an embedding lookup's tokens) as a weight of T panels of 1 column."""
    return type(w)(*(a[p, ..., c][..., None] for a in w))


# ---- GGUF bytes <-> panels ----------------------------------------------------------------------
def _q4k_scales(sb):
    """A Q4_K super-block's 12 scale bytes [..., 12] -> (sc, m) [..., 8], 6 bits each."""
    a, b, c = sb[..., 0:4], sb[..., 4:8], sb[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | (a >> 6) << 4], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | (b >> 6) << 4], axis=-1)
    return sc, m


def from_gguf(raw: np.ndarray, type_name: str) -> KQuantWeight:
    """A GGUF Q4_K / Q6_K tensor's bytes (N rows, bytes per row) -> its panels for the [K, N]
    kernel; values bit for bit those of `gguf.quants.dequantize`."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, GGUF_BYTES[type_name])  # [N, K / 256, bytes]
    nb = blocks.shape[1]

    def half(a):  # [N, nb, 2] bytes -> f16 [N, nb]
        return np.ascontiguousarray(a).view(np.float16)[..., 0]

    if type_name == "Q4_K":
        sc, m = _q4k_scales(blocks[:, :, 4:16])  # [N, nb, 8]
        qs = blocks[:, :, 16:].reshape(n, nb, 4, 1, 32)  # 32 bytes: sub-block 2c low, 2c + 1 high
        vals = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1)  # [N, K]
        q = _to_panels(vals.T)
        s = np.stack([_to_panels(sc.reshape(n, -1).T), _to_panels(m.reshape(n, -1).T)], axis=2)
        d = np.stack([_to_panels(half(blocks[:, :, 0:2]).T), _to_panels(half(blocks[:, :, 2:4]).T)], axis=2)
        return Q4KWeight(np.ascontiguousarray(q[:, 0::2] | q[:, 1::2] << 4), s, d)
    ql = blocks[:, :, :128].reshape(n, nb, 2, 1, 64)  # half h: byte j low -> 64 h + j, high -> + 64
    qh = blocks[:, :, 128:192].reshape(n, nb, 2, 1, 32)  # bits 2t of byte j -> 128 h + 32 t + j
    lo = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(n, -1)
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3).reshape(n, -1)
    scales = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(n, -1)
    return pack_q6k(_to_panels((lo | hi << 4).T), _to_panels(scales.T), _to_panels(half(blocks[:, :, 208:210]).T))


def pack_q6k(q6, s, d) -> Q6KWeight:
    """6-bit values u8[P, K, 64] (0..63), scales i8[P, K / 16, 64], d f16[P, K / 256, 64] -> Q6KWeight."""
    p, k, c = q6.shape
    v = q6.reshape(p, k // SUPER, SUPER, c)
    lo = v[:, :, 0::2] & 15 | (v[:, :, 1::2] & 15) << 4
    hi = sum((v[:, :, t::4] >> 4) << (2 * t) for t in range(4)).astype(np.uint8)
    return Q6KWeight(np.ascontiguousarray(np.concatenate([lo, hi], axis=2)), s, d)


def quantize_gguf(w_out_in, type_name: str) -> np.ndarray:
    """Float [N, K] (K % 256 == 0) -> GGUF Q4_K / Q6_K bytes [N, K / 256 * block bytes], the block
    layout llama.cpp reads. A plain min/max (Q4_K) or absmax (Q6_K) fit per sub-block, not
    llama.cpp's search for the best scales: the format is the same, the error a little larger.
    (The `gguf` package quantizes neither type.)"""
    x = np.asarray(w_out_in, np.float32)
    n = x.shape[0]
    x = x.reshape(n, -1, SUPER)
    nb = x.shape[1]

    def div(a, b):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0)

    if type_name == "Q4_K":
        sub = x.reshape(n, nb, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
        scale, mn = (hi - lo) / 15, -lo
        d = (scale.max(-1) / 63).astype(np.float16)
        dmin = (mn.max(-1) / 63).astype(np.float16)
        sc = np.clip(np.rint(div(scale, d[..., None].astype(np.float32))), 0, 63).astype(np.uint8)
        m = np.clip(np.rint(div(mn, dmin[..., None].astype(np.float32))), 0, 63).astype(np.uint8)
        es = d[..., None].astype(np.float32) * sc
        em = dmin[..., None].astype(np.float32) * m
        q = np.clip(np.rint(div(sub + em[..., None], es[..., None])), 0, 15).astype(np.uint8)
        scales = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                                 (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], axis=-1)
        qs = (q[:, :, 0::2] | q[:, :, 1::2] << 4).reshape(n, nb, 128)
        parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, qs]
    else:
        sub = x.reshape(n, nb, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = (scale.max(-1) / 127).astype(np.float16)
        sc = np.clip(np.rint(div(scale, d[..., None].astype(np.float32))), -128, 127).astype(np.int8)
        es = d[..., None].astype(np.float32) * sc
        q = (np.clip(np.rint(div(sub, es[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, nb, 2, 4, 32)
        ql = (q[:, :, :, 0:2] & 15 | (q[:, :, :, 2:4] & 15) << 4).reshape(n, nb, 128)
        qh = sum((q[:, :, :, t] >> 4) << (2 * t) for t in range(4)).astype(np.uint8).reshape(n, nb, 64)
        parts = [ql, qh, sc.view(np.uint8), d[..., None].view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)
