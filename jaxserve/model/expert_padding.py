"""Routed experts padded for tensor parallelism (the layouts are model/sharding.py's): MXFP4 experts
to `sharding.packed_intermediate`'s whole 32-value blocks per device, experts kept in a weight format
(ExpertStack) to whole 64-column panels / K blocks per device (`stack_intermediate`). Padded rows and
blocks are zeros, which decode to exactly zero outputs; expert parallelism (whole experts) needs none."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UserError
from jaxserve.model.config import ModelConfig
from jaxserve.runtime import mxfp4, panels, weight_formats

log = logging.getLogger(__name__)


def _pad_axis(a, axis: int, size: int, value: int = 0):
    """a (numpy, jax or a ShapeDtypeStruct) padded with `value` to `size` along `axis`."""
    if a.shape[axis] == size:
        return a
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[:axis] + (size,) + a.shape[axis + 1:], a.dtype)
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return (np.pad if isinstance(a, np.ndarray) else jnp.pad)(a, widths, constant_values=value)


def pad_packed_experts(params: dict, cfg: ModelConfig, sharded: ModelConfig, tp: int = 1) -> dict:
    """MXFP4 experts (and gpt-oss's gate / up biases) padded from cfg's intermediate size to
    sharded's (`packed_intermediate`): gate / up gain zero output rows (blocks and scales), down
    zero K blocks; a padded row's gate and up are 0 + 0, so its activation and output are 0.
    Experts kept in a weight format (ExpertStack) are padded the same way where tensor parallelism
    would split their panels or blocks (`pad_expert_stacks`)."""
    params = pad_expert_stacks(params, cfg, tp)
    i = sharded.moe_intermediate_size
    if i == cfg.moe_intermediate_size or not isinstance(params, dict):
        return params
    out = dict(params)
    for layer in cfg.moe_layers:
        experts = dict(out[f"layers_{layer}"]["mlp"]["experts"])
        for name, w in experts.items():
            if isinstance(w, mxfp4.Mxfp4Weight):  # gate / up: N (axis 1) = I; down: K / 32 (axis 2) = I / 32
                axis, size = (2, i // mxfp4.BLOCK) if name == "down_proj" else (1, i)
                experts[name] = mxfp4.Mxfp4Weight(*(_pad_axis(a, axis, size) for a in w))
            elif name in ("gate_bias", "up_bias"):
                experts[name] = _pad_axis(w, 1, i)
        out[f"layers_{layer}"] = {**out[f"layers_{layer}"], "mlp": {**out[f"layers_{layer}"]["mlp"],
                                                                    "experts": experts}}
    return out


def stack_intermediate(experts: dict, i: int, tp: int) -> int:
    """The intermediate size I of a layer's routed experts padded so that each of tp devices holds
    whole 64-column panels of gate / up stacks (their N = I) and whole blocks of a down stack's K = I
    (32 values, a K-quant's super-block 256): e.g. Qwen3-30B-A3B's I = 768 at TP 8, Q8_0 experts
    -> 1024 (128 per device), Q4_K / Q6_K down -> 2048 (one super-block per device)."""
    unit = 1
    for name, w in experts.items():
        if isinstance(w, weight_formats.ExpertStack):
            block = weight_formats.block_of(weight_formats.format_of(w.w).name) if name == "down_proj" else 1
            unit = math.lcm(unit, panels.PANEL if name != "down_proj" else block)
    unit *= tp
    return -(-i // unit) * unit


def stacked_intermediate(params, mc: ModelConfig) -> int | None:
    """The routed experts' intermediate size as their weight-format stacks hold it per model (padded
    under TP to whole panels / blocks per device: pad_expert_stacks), or None where
    the experts are not stacks in a weight format."""
    if not mc.is_moe:
        return None
    experts = params[f"layers_{mc.moe_layers[0]}"]["mlp"]["experts"]
    down = experts.get("down_proj")
    return down.shape[1] if isinstance(down, weight_formats.ExpertStack) else None


def _pad_stack(w, name: str, i: int, size: int):
    """One routed-expert weight padded from intermediate size i to size with values that decode to
    0: gate / up's N (an ExpertStack's panels and per-channel scales, zero scales; a float stack's
    axis 2, a bias's axis 1), down's K (axis 2 of a stack's blocked parts: zero blocks, or W8A8's
    offset code 128 = 0 under its per-channel scale; a float stack's axis 1)."""
    if isinstance(w, weight_formats.ExpertStack):
        if name == "down_proj":
            zero = 128 if isinstance(w.w, weight_formats.W8A8Weight) else 0
            parts = (_pad_axis(a, 2, a.shape[2] * size // i, zero if a.ndim >= 4 else 0) if a.ndim >= 3 else a
                     for a in w.w)
        else:
            parts = (_pad_axis(a, 1, size // panels.PANEL if a.ndim >= 3 else size) for a in w.w)
        return weight_formats.ExpertStack(type(w.w)(*parts))
    return _pad_axis(w, 1 if name in ("down_proj", "gate_bias", "up_bias") else 2, size)


def pad_expert_stacks(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """Routed experts kept in a weight format (ExpertStack: a GGUF's blocks as stored, w8a8, ...)
    under tensor (not expert) parallelism, with I padded to `stack_intermediate` (float experts and
    gate / up biases beside them too): the zero gate / up columns give h = silu(0) * 0 = 0, which
    the down projection's padded K rows multiply. A UserError where a format cannot be padded
    (mxfp4a8's panels of MXFP4 experts with their gpt-oss biases padded by `packed_intermediate`)."""
    if tp == 1 or cfg.expert_parallel or not isinstance(params, dict):
        return params
    out, padded = dict(params), {}
    for layer in cfg.moe_layers:
        mlp = out[f"layers_{layer}"]["mlp"]
        experts = dict(mlp["experts"])
        stacks = [w for w in experts.values() if isinstance(w, weight_formats.ExpertStack)]
        if not stacks:
            continue
        if any(isinstance(w.w, (mxfp4.Mxfp4A8Weight, mxfp4.Mxfp4Panels)) for w in stacks):
            raise UserError(f"--quantization mxfp4a8 keeps MXFP4 experts whole, not split on their intermediate "
                            f"axis: with tensor_parallel_size={tp} add --enable-expert-parallel (or use "
                            "tensor_parallel_size 1, or no --quantization).", param="quantization")
        i = experts["down_proj"].shape[1]
        size = stack_intermediate(experts, i, tp)
        if size != i:
            padded[(i, size)] = padded.get((i, size), 0) + 1
            experts = {n: _pad_stack(w, n, i, size) if n in ("gate_proj", "up_proj", "down_proj", "gate_bias",
                                                                "up_bias") else w for n, w in experts.items()}
        out[f"layers_{layer}"] = {**out[f"layers_{layer}"], "mlp": {**mlp, "experts": experts}}
    for (i, size), n in padded.items():
        log.warning("%d MoE layers: routed experts' intermediate size %d padded to %d under tensor_parallel_size=%d "
                    "for whole panels / blocks of their weight formats per device (%.2fx their bytes; "
                    "--enable-expert-parallel splits whole experts instead, unpadded)", n, i, size, tp, size / i)
    return out
