"""How many KV blocks fit on a device: sized after the weights are placed and the largest step
is compiled, from the device's own numbers, so that what we plan is what the allocator can give.

KV bytes = utilization x the device's memory limit - bytes already in use (the weights, the
runtime's own buffers) - the step's peak temporary bytes (XLA's memory analysis of the compiled
largest bucket) - a margin. A pure function of those numbers, so it is tested with fake device
stats; the engine supplies the real ones (``compat.memory_stats``, ``compat.peak_temp_bytes``).
Under tensor parallelism every number is per device (KV bytes per block too: each device holds
its share of the kv heads).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from typing import Any

from jaxserve.errors import UserError
from jaxserve.runtime import compat

GiB = 1 << 30
DEFAULT_UTILIZATION = 0.9
DEFAULT_MARGIN = 256 << 20  # allocator fragmentation, small runtime buffers allocated later


# jax's GPU allocator: the pool is a fraction of the device's memory (75% by default), read once,
# when jax starts its GPU backend. jaxlib >= 0.10 reads XLA_CLIENT_MEM_FRACTION and the deprecated
# XLA_PYTHON_CLIENT_MEM_FRACTION, and refuses the two together (`generate_pjrt_gpu_plugin_options`
# raises; jax's plugin discovery logs it and carries on without the GPU). So we set exactly the first,
# and nothing where the user set either.
POOL_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"
POOL_FRACTION_ENV = (POOL_FRACTION_VAR, "XLA_PYTHON_CLIENT_MEM_FRACTION")
_pool_fraction: float | None = None  # what size_gpu_pool set, in this process


def size_gpu_pool(utilization: float, env: dict | None = None, started: bool | None = None) -> float | None:
    """Make jax's GPU pool `utilization` of the device, so that --gpu-memory-utilization 0.9 means
    90% of the GPU (as in vLLM), not 0.9 x jax's default 75% pool. Only before jax has started its
    backends and where the user set no pool of their own (a fraction, or the on-demand platform
    allocator); returns the fraction the pool was given, None if it was left alone."""
    global _pool_fraction
    env = os.environ if env is None else env
    if _pool_fraction is not None and env is os.environ:
        return _pool_fraction
    if started is None:
        started = compat.backends_started()
    if started or any(k in env for k in POOL_FRACTION_ENV) or env.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return None
    if not 0.0 < utilization <= 1.0:
        return None  # plan_kv_memory names the bad value
    env[POOL_FRACTION_VAR] = f"{utilization:.4g}"
    if env is os.environ:
        _pool_fraction = utilization
    return utilization


def device_total(limit: int, platform: str, pool_fraction: float | None = None) -> int:
    """The device's memory behind an allocator `limit`: on a GPU whose pool size_gpu_pool made
    `pool_fraction` of the device, limit / fraction; elsewhere the limit is the device's."""
    pool = _pool_fraction if pool_fraction is None else pool_fraction
    return int(limit / pool) if platform == "gpu" and pool else limit


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    device_limit: int  # bytes the device's allocator can hand out
    utilization: float
    weight_bytes: int  # in use after the weights were placed (weights + runtime buffers)
    activation_bytes: int  # the compiled step's peak temporaries
    margin_bytes: int
    kv_bytes: int  # num_blocks * block_bytes
    block_bytes: int  # KV bytes of one block on one device
    block_size: int
    num_blocks: int
    max_model_len: int
    tensor_parallel_size: int = 1
    reserved_blocks: int = 0  # allocated but holding no request's KV (the engine's null block)

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV that requests can use."""
        return (self.num_blocks - self.reserved_blocks) * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of ``max_model_len`` tokens fit in the KV cache at once."""
        return self.kv_tokens / self.max_model_len


def device_memory(device: Any) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) of a device, None where the backend keeps no stats (CPU)."""
    stats = compat.memory_stats(device)
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def has_device_stats() -> bool:
    """Whether the default device reports its memory (accelerators do; XLA:CPU does not)."""
    import jax

    return device_memory(jax.devices()[0]) is not None


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_kv_memory(
    *,
    device_limit: int,
    bytes_in_use: int,
    activation_bytes: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    utilization: float = DEFAULT_UTILIZATION,
    margin_bytes: int = DEFAULT_MARGIN,
    tensor_parallel_size: int = 1,
    reserved_blocks: int = 0,
    allocator_limit: int | None = None,
) -> MemoryPlan:
    """The KV plan, or a UserError naming what does not fit and the flags that change it.
    `allocator_limit`: what the allocator can hand out, where less than the device (a GPU pool)."""
    if not 0.0 < utilization <= 1.0:
        raise UserError(
            f"--gpu-memory-utilization={utilization} must be in (0, 1]: it is the fraction of "
            "each device's memory jaxserve may use (default 0.9)",
            param="gpu_memory_utilization",
        )
    if block_bytes <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError(f"bad KV geometry: {block_bytes=} {block_size=} {max_model_len=}")
    budget = int(utilization * device_limit)
    if allocator_limit is not None:
        budget = min(budget, allocator_limit)
    tp = f" per device (tensor parallel size {tensor_parallel_size})" if tensor_parallel_size > 1 else ""
    where = (
        f"the model's weights take {_gib(bytes_in_use)}{tp} and the largest compiled step "
        f"{_gib(activation_bytes)} of temporaries, against {_gib(budget)} usable "
        f"(--gpu-memory-utilization {utilization} x {_gib(device_limit)} device memory)"
    )
    kv_bytes = budget - bytes_in_use - activation_bytes - margin_bytes
    if kv_bytes < (reserved_blocks + 1) * block_bytes:
        if bytes_in_use + margin_bytes > budget:
            fix = (
                "raise --tensor-parallel-size to split the weights over more devices, use a "
                "smaller or quantized model, or raise --gpu-memory-utilization"
            )
        else:
            fix = (
                "lower --max-num-batched-tokens or --max-num-seqs (smaller compiled steps), "
                "raise --tensor-parallel-size, or raise --gpu-memory-utilization"
            )
        raise UserError(f"out of device memory: {where}; no room is left for the KV cache: {fix}",
                        param="gpu_memory_utilization")
    num_blocks = kv_bytes // block_bytes
    plan = MemoryPlan(
        device_limit=device_limit,
        utilization=utilization,
        weight_bytes=bytes_in_use,
        activation_bytes=activation_bytes,
        margin_bytes=margin_bytes,
        kv_bytes=num_blocks * block_bytes,
        block_bytes=block_bytes,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        reserved_blocks=reserved_blocks,
    )
    if plan.kv_tokens < max_model_len:
        raise UserError(
            f"the KV cache holds {plan.kv_tokens} tokens ({_gib(plan.kv_bytes)}) but "
            f"--max-model-len is {max_model_len}: {where}. Lower --max-model-len to at most "
            f"{plan.kv_tokens}, or raise --gpu-memory-utilization or --tensor-parallel-size",
            param="max_model_len",
        )
    return plan


def summary(plan: MemoryPlan) -> str:
    """One log line: where each byte of the device goes, and what that buys."""
    tp = f" x tp {plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else ""
    return (
        f"memory per device{tp}: {_gib(plan.device_limit)} x {plan.utilization:g} = "
        f"weights {_gib(plan.weight_bytes)} + activations {_gib(plan.activation_bytes)} + "
        f"margin {_gib(plan.margin_bytes)} + KV {_gib(plan.kv_bytes)} "
        f"({plan.num_blocks} blocks x {plan.block_size} tokens = {plan.kv_tokens} tokens); "
        f"max concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len} tokens/request"
    )


# The sampler holds a few [S, V] float32 arrays at once (logits, scaled logits, weights, a sort's
# values and indices, log-softmax): an upper count, checked against XLA's memory analysis.
SAMPLER_ROW_COPIES = 8


def estimate_step_bytes(
    *,
    num_tokens: int,
    num_seqs: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    dtype_bytes: int,
    tensor_parallel_size: int = 1,
    num_experts_per_tok: int = 0,
    moe_intermediate_size: int = 0,
    expert_parallel: bool = False,
    dense_experts: int = 0,
) -> int:
    """Peak temporary bytes of one step on one device, where no compiled executable can say
    (lowering for another platform): one layer's live activations - the residual stream and its
    normed copy, q/k/v and the attention output (f32 too), the gated MLP's three [T, I] arrays -
    plus the sampler's [S, V] float32 rows (the logits are gathered whole on every device).
    Layers run one after another, so one layer's worth is live at a time. A mixture-of-experts layer
    (runtime/moe.py) holds T x k dispatched rows: the gathered input, the experts' three [I] arrays
    (I / tp of each expert, or whole experts under expert parallelism) and a float32 output row;
    dropless with static shapes, every device holds all T x k rows whatever the routing.
    ``dense_experts``: the experts per device where the compiler turns the grouped product into a
    masked product over every expert (XLA:GPU on jax 0.10: ``ragged_dot`` becomes one dot whose
    operand is the T x k rows repeated per expert, [T*k, E*max(H, I)]): that operand counts too."""
    tp = tensor_parallel_size
    heads = max(num_heads // tp, 1)
    kv_heads = max(num_kv_heads // tp, 1)
    per_token = (
        3 * hidden_size * dtype_bytes
        + (2 * heads + 2 * kv_heads) * head_dim * dtype_bytes
        + heads * head_dim * 4
        + 3 * (intermediate_size // tp) * dtype_bytes
        + 2 * head_dim * 4  # RoPE cos/sin
    )
    if num_experts_per_tok:
        inter = moe_intermediate_size if expert_parallel else moe_intermediate_size // tp
        per_token += num_experts_per_tok * (hidden_size * dtype_bytes + 3 * inter * dtype_bytes + hidden_size * 4)
        per_token += num_experts_per_tok * dense_experts * max(hidden_size, inter) * dtype_bytes
    return num_tokens * per_token + num_seqs * vocab_size * 4 * SAMPLER_ROW_COPIES


# ---- host memory maps ----------------------------------------------------------------------------
# Each compiled XLA:CPU step loads its kernels as ~130 separate JIT modules, ~390 memory maps (code,
# read-only data, data), and Linux refuses a process more than vm.max_map_count maps (65530 by
# default). Past it the next compile or cache load crashes inside XLA, with no error to read.
MAP_COUNT_WARN_FRACTION = 0.5


def memory_maps() -> tuple[int, int] | None:
    """(maps this process holds, vm.max_map_count), or None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


def map_count_warning(held: int, limit: int, executables: int) -> str | None:
    """A warning once the process holds over half its map limit, naming the fix; else None."""
    if held <= MAP_COUNT_WARN_FRACTION * limit:
        return None
    return (f"This process holds {held} of the {limit} memory maps Linux allows it (vm.max_map_count), "
            f"{executables} compiled steps included; one more compile past the limit crashes XLA. "
            "Raise it (sudo sysctl -w vm.max_map_count=262144) or compile fewer buckets "
            "(a lower --max-num-seqs or --max-num-batched-tokens).")


def warn_on_map_count(executables: int) -> None:
    """Log map_count_warning's warning when this process's memory maps near the limit."""
    maps = memory_maps()
    warning = maps and map_count_warning(*maps, executables)
    if warning:
        logging.getLogger("jaxserve").warning(warning)


def trim_heap() -> None:
    """Hand the heap that compiling freed back to the OS (glibc's malloc_trim). Compiling every
    step bucket leaves ~0.3 GiB of freed compile-time memory resident in glibc's arenas
    (bench/memory.py's "heap trimmed" phase); a no-op where the C library has no malloc_trim."""

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
