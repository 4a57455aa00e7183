"""How many KV blocks the engine gets: from an explicit budget (or, on CPU, a share of RAM) before
the runner is built, or on an accelerator after the weights are placed and the largest step is
compiled, from what the device has left (as vLLM and SGLang do)."""

from __future__ import annotations

import logging

import jax

from jaxserve.config import EngineConfig
from jaxserve.errors import UserError
from jaxserve.model.config import ModelConfig
from jaxserve.runtime import memory
from jaxserve.runtime import kv_sizing

log = logging.getLogger("jaxserve")


def sized_on_device(config: EngineConfig) -> bool:
    """No explicit size and a device that reports its memory: the plan waits for the runner."""
    return config.num_blocks is None and config.kv_cache_memory is None and memory.has_device_stats()


def initial_blocks(config: EngineConfig, mc: ModelConfig, kv_dtype: str, max_model_len: int,
                   kv_for_sequences: int | None = None) -> tuple[int, bool]:
    """(KV blocks to allocate now, whether the device plan resizes them after the runner's largest
    step). kv_for_sequences: with no --kv-cache-memory or --num-blocks, a host KV cache holds only
    this many max_model_len sequences where the budget would give more (`jaxserve generate` runs
    one prompt at a time: allocating, zeroing and holding 1 GiB costs it ~0.5 s and its RSS)."""
    on_device = sized_on_device(config)
    blocks = config.num_blocks or (2 if on_device else blocks_from_budget(config, mc, kv_dtype))
    if kv_for_sequences and not (config.num_blocks or config.kv_cache_memory or on_device):
        needed = kv_for_sequences * -(-max_model_len // config.block_size)
        needed += int(config.watermark * needed) + 2  # admission's watermark, the null block
        blocks = min(blocks, needed)
    return blocks, on_device


def blocks_from_budget(config: EngineConfig, mc: ModelConfig, dtype: str) -> int:
    budget = kv_sizing.kv_memory_budget(config.kv_cache_memory, config.memory_fraction, 0)
    per_block = kv_sizing.kv_bytes_per_block(mc, config.block_size, dtype, config.tensor_parallel_size)  # per device
    blocks = budget // per_block
    if blocks < 2:
        raise UserError(
            f"The KV cache budget of {budget / 2**20:.1f} MiB holds no block of {per_block / 2**20:.2f} MiB: "
            "raise --kv-cache-memory or --gpu-memory-utilization."
        )
    return int(blocks)


def plan_device_memory(config: EngineConfig, mc: ModelConfig, runner, kv_dtype: str, max_model_len: int) -> int:
    """Size the runner's KV cache to what the device has left, not yet allocated; returns the block
    count. Steps compile against the planned shapes before the cache takes the memory: XLA's GPU
    autotuner allocates its trial buffers (the LM head's alone ~1 GB on an 8B model) from the same pool."""
    limit, in_use = memory.device_memory(jax.devices()[0])
    tp = config.tensor_parallel_size
    plan = memory.plan_kv_memory(  # a GPU pool sized by size_gpu_pool: planned against the whole device
        device_limit=memory.device_total(limit, jax.default_backend()), allocator_limit=limit,
        bytes_in_use=in_use, activation_bytes=runner.peak_step_bytes(),
        block_bytes=kv_sizing.kv_bytes_per_block(mc, config.block_size, kv_dtype, tp, runner.backend.kv_layout),
        block_size=config.block_size, max_model_len=max_model_len,
        utilization=config.gpu_memory_utilization, tensor_parallel_size=tp, reserved_blocks=1,
    )
    log.info(memory.summary(plan))
    runner.resize_kv(plan.num_blocks, allocate=False)  # allocated once the buckets compiled (LLMEngine)
    return plan.num_blocks


def log_kv_cache(config: EngineConfig, mc: ModelConfig, runner, num_blocks: int, kv_dtype: str,
                 max_model_len: int) -> int:
    """Log the cache's size; returns its capacity in tokens (one block is the null block)."""
    cap_tokens = (num_blocks - 1) * config.block_size
    log.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max concurrency at max_model_len=%d: %.2f",
        num_blocks - 1, config.block_size, cap_tokens,
        num_blocks * kv_sizing.kv_bytes_per_block(mc, config.block_size, kv_dtype,
                                                  layout=runner.backend.kv_layout) / 2**20,
        kv_dtype, max_model_len, cap_tokens / max_model_len,
    )
    return cap_tokens
