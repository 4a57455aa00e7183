"""RoPE frequencies: the default, linear, llama3 and YaRN scalings, on host (float64 numpy).

`inv_freq(theta, dim, scaling)` returns the inverse frequencies of the `dim` rotary dims and the
attention factor that multiplies cos and sin (1 except for YaRN, whose factor sharpens attention
at long context); the model computes its cos/sin tables from them once per step, one table per
RoPE kind (Gemma 3's local and global layers each have their own base and scaling).
"""

from __future__ import annotations

import math

import numpy as np

from jaxserve.errors import UserError

KINDS = ("default", "linear", "llama3", "yarn")


def kind_of(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def inv_freq(theta: float, dim: int, scaling: dict | None = None,
             max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """(f64[dim // 2] inverse frequencies, attention factor) for one RoPE kind."""
    base = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    kind = kind_of(scaling)
    if kind == "default":
        return base, 1.0
    rs = scaling
    if kind == "linear":
        return base / float(rs["factor"]), 1.0
    if kind == "llama3":
        return _llama3(base, rs), 1.0
    if kind == "yarn":
        return _yarn(base, theta, dim, rs, max_position_embeddings)
    raise UserError(f"Unsupported rope_scaling type {kind!r}: jaxserve supports {', '.join(KINDS)}.",
                    param="rope_scaling")


def _llama3(inv: np.ndarray, rs: dict) -> np.ndarray:
    factor = float(rs["factor"])
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(inv: np.ndarray, theta: float, dim: int, rs: dict, max_pos: int | None) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): dims that rotate fewer than beta_slow times over the original context
    are interpolated (divided by factor), those rotating more than beta_fast times kept, a linear
    ramp between; cos/sin are scaled by 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio,
    or an explicit attention_factor), as transformers computes it."""
    if "original_max_position_embeddings" not in rs:
        raise UserError("rope_scaling type 'yarn' needs original_max_position_embeddings (the pretraining "
                        "context) in config.json.", param="rope_scaling")
    orig = float(rs["original_max_position_embeddings"])
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else float(max_pos or orig) / orig
    attention = rs.get("attention_factor")
    if attention is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                     else _mscale(factor))
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency
    return inv / factor * (1 - extrapolation) + inv * extrapolation, float(attention)
