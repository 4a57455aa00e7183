"""How big the KV cache is: the shape and dtype of one block of one layer's KV array, its bytes on
one device, the default compute and KV dtypes, and the memory budget the cache may take."""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from jaxserve.runtime import compat
from pallas_kernels import kv_quant


class KVGeometry(Protocol):
    """What the KV cache's size depends on in a model's config (`model.config.ModelConfig` has
    these; the runtime does not import the model's config). Read-only, so a frozen dataclass fits."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def dtype_size(dtype: str) -> int:
    return np.dtype(kv_storage_dtype(dtype)).itemsize


def kv_storage_dtype(name: str):
    """The dtype a KV cache's values are stored in: the dtype itself, or a quantized format's data
    dtype (int8, float8_e4m3fn, float8_e5m2)."""
    return kv_quant.KV_QUANT_DTYPES.get(name) or jnp.dtype(name)


def kv_block_shape(layout: str, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> tuple:
    """One block of one layer's KV array (K and V together for tpu-fused, else each of the two)."""
    if layout == "tpu-fused":
        from pallas_kernels import tpu

        return tpu.fused_shape(1, block_size, num_kv_heads, head_dim, dtype)[1:]
    return block_size, num_kv_heads, head_dim


def kv_bytes_per_block(model_cfg: KVGeometry, block_size: int, dtype: str, tensor_parallel_size: int = 1,
                       layout: str = "paged") -> int:
    """KV bytes of one block on one device (kv heads split over tp, at least one head each), as
    allocated: the tpu-fused layout's head-dim padding counts, so the budget is physical memory; a
    quantized cache counts its data and its float32 scale per (token, kv head) (tpu-fused: the
    scales' [2 * Hkv, block_size] tile as HBM pads it, ``tpu.scale_page_bytes``)."""
    tp = tensor_parallel_size
    heads = max(model_cfg.num_kv_heads // tp, 1) if tp > 1 else model_cfg.num_kv_heads
    arrays = 1 if layout == "tpu-fused" else 2
    shape = kv_block_shape(layout, block_size, heads, model_cfg.head_dim, kv_storage_dtype(dtype))
    scales = 4 * int(np.prod(shape[:-1])) if kv_quant.is_quantized(dtype) else 0
    if scales and layout == "tpu-fused":
        from pallas_kernels import tpu

        scales = tpu.scale_page_bytes(block_size, heads)
    return arrays * model_cfg.num_layers * (int(np.prod(shape)) * dtype_size(dtype) + scales)


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def default_kv_cache_dtype(dtype: str, checkpoint_dtype: str | None) -> str:
    """The KV cache's dtype when none is asked for: the compute dtype, except that a bfloat16
    checkpoint (a quantized GGUF counts as one) computed in float32 keeps its K/V in bfloat16, the
    precision the model has always run at (vLLM's `auto` stores the checkpoint's dtype too). That
    halves the KV memory and the bytes each decode step reads; matmuls and attention math stay
    float32."""
    return "bfloat16" if dtype == "float32" and checkpoint_dtype == "bfloat16" else dtype


def kv_memory_budget(kv_cache_memory: int | None, memory_fraction: float, weight_bytes: int) -> int:
    """Bytes for the KV cache: an explicit budget, else a fraction of the device's free memory.

    CPU backends report no memory stats; there the fraction applies to available host RAM, and
    the default is capped at 1 GiB (as vLLM's CPU backend caps its KV space by default).
    """
    if kv_cache_memory is not None:
        return int(kv_cache_memory)
    stats = compat.memory_stats(jax.devices()[0])
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * memory_fraction)
    return int(min(psutil.virtual_memory().available * memory_fraction, 1 << 30))
