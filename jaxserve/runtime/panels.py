"""The layout every quantized weight format shares (runtime/weight_formats.py): a [K, N] kernel as
[N / 64, K, 64] panels, each contiguous, the float32 packed matmul's (csrc/matmul.cc), with blocks
of 32 weights running along K; and the panels' k values interleaved per 32-bit word, as the
CPU's dot-product instructions read them (csrc/dot_matmul.cc). numpy at load time, jnp inside the
computation."""

from __future__ import annotations

import numpy as np

PANEL = 64  # columns per panel (csrc/matmul.cc, csrc/quant_matmul.cc)
BLOCK = 32  # weights per GGUF block, along K


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


def nibbles(q4):
    """u8[P, K / 2, 64] -> u8[P, K, 64] values 0..15 (numpy or jnp)."""
    p, half, c = q4.shape
    return (q4[:, :, None, :] >> np.array([0, 4], np.uint8)[:, None] & 15).reshape(p, 2 * half, c)
