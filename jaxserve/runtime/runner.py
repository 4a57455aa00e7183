"""The device side of a step: weights and per-layer KV arrays on devices, one compiled forward per
token bucket, on-device sampling.

The forward is compiled ahead of time per (T, S) bucket and kept in a dict, so a steady-state step
can never silently recompile: `num_compiles` only grows when a new shape is met.

Tensor parallelism (`tensor_parallel_size` > 1): params, KV caches and the compiled forward are laid
out on a ("data", "model") mesh by `jaxserve.runtime.mesh`; the forward is compiled with explicit
in/out shardings (batch inputs, logits and sampled tokens replicated).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.default_model import cache_dir
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.runtime import cpu_kernels
from jaxserve.runtime import mesh as meshlib
from jaxserve.runtime.attention import AttentionMetadata, layer_attention
from jaxserve.runtime.input_batch import StepInputs, next_pow2, token_buckets
from jaxserve.runtime.sampler import SampleResult, SamplingMode, SamplingTensors, sample

log = logging.getLogger("jaxserve")


def enable_compilation_cache(path: str | None = None) -> str:
    path = path or os.environ.get("JAXSERVE_COMPILATION_CACHE") or str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str = "xla"
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    kv_cache_dtype: str | None = None  # default: dtype


def pack_linear_kernels(params: dict, tied_embeddings: bool) -> dict:
    """What `LlamaForCausalLM(packed=True)` holds as panels, packed: every linear layer's [K, N]
    kernel with N % 64 == 0, and a tied embedding table [V, H] as its transpose (the LM head)."""

    def pack(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if names[-1] == "kernel" and cpu_kernels.packable(leaf.shape):
            return cpu_kernels.pack_kernel(leaf)
        if tied_embeddings and names[-2:] == ["embed_tokens", "embedding"] and cpu_kernels.packable(leaf.T.shape):
            return cpu_kernels.pack_kernel(leaf.T)
        return leaf

    return jax.tree_util.tree_map_with_path(pack, params)


def dtype_size(dtype: str) -> int:
    return np.dtype(jnp.dtype(dtype)).itemsize


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params, cfg: RunnerConfig, mesh=None):
        """params: a numpy tree (placed shard by shard) or a lazy checkpoint with
        `restore(shardings, dtype)` (an Orbax checkpoint, restored straight onto the mesh)."""
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.dtype)
        self.mesh = mesh if mesh is not None else meshlib.make_mesh(cfg.tensor_parallel_size)
        tp = meshlib.tp_size(self.mesh)
        self.source_config = model_cfg
        # With tp > num_kv_heads each kv head is repeated so every device holds one (see mesh.py).
        self.model_cfg = model_cfg = meshlib.sharded_config(model_cfg, tp)
        self.kv_repeat = meshlib.kv_replication(self.source_config, tp)
        # The `cpu` backend also runs the linear layers natively, on weights packed once here.
        self.packed = cfg.attention_backend == "cpu" and tp == 1 and cpu_kernels.native_float32(self.dtype)
        self.model = LlamaForCausalLM(
            model_cfg, meshlib.shard_attention(layer_attention(cfg.attention_backend), self.mesh), self.dtype,
            self.packed,
        )
        self.params = self._place_params(params)
        self._replicated = meshlib.replicated(self.mesh)
        if self.packed:
            self.params = pack_linear_kernels(self.params, model_cfg.tie_word_embeddings)
            self.param_shardings = jax.tree.map(lambda _: self._replicated, self.params)
        self.inv_freq = jax.device_put(np.asarray(model_cfg.rope_inv_freq(), np.float32), self._replicated)
        self.kv_sharding = meshlib.kv_cache_sharding(self.mesh)
        shape = (cfg.num_blocks, cfg.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_dtype = jnp.dtype(cfg.kv_cache_dtype or cfg.dtype)
        zeros = jax.jit(lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=self.kv_sharding)
        self.kv_caches = [(zeros(), zeros()) for _ in range(model_cfg.num_layers)]
        self.max_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.t_buckets = token_buckets(cfg.max_num_batched_tokens)
        self.s_max = next_pow2(cfg.max_num_seqs)
        rep, kv = self._replicated, self.kv_sharding
        self._forward = jax.jit(
            self._forward_impl, donate_argnums=(1,),
            in_shardings=(self.param_shardings, kv, rep, rep, rep, rep, rep), out_shardings=(rep, kv),
        )
        self._sample = jax.jit(sample, static_argnums=(2,), in_shardings=(rep, rep), out_shardings=rep)
        self._compiled: dict[tuple[int, int], object] = {}
        self.num_compiles = 0

    def _place_params(self, params) -> dict:
        mc, mesh = self.source_config, self.mesh
        if hasattr(params, "restore"):  # lazy checkpoint: restore straight into the target layout
            shapes = params.shapes()
            params = params.restore(meshlib.checkpoint_shardings(shapes, mc, mesh), self.dtype)
        else:
            shapes = meshlib.shape_tree(params)
            params = meshlib.place_host_params(params, meshlib.checkpoint_shardings(shapes, mc, mesh), self.dtype)
        self.param_shardings = meshlib.param_shardings(meshlib.expanded_shapes(shapes, mc, self.kv_repeat), mc, mesh)
        return meshlib.expand_kv_heads(params, mc, self.kv_repeat, self.param_shardings)

    @property
    def tensor_parallel_size(self) -> int:
        return meshlib.tp_size(self.mesh)

    # ---- shapes -------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = next(b for b in self.t_buckets if b >= num_tokens)
        s = min(max(next(b for b in self.t_buckets if b >= num_seqs), min(t, self.s_max)), self.s_max)
        return t, s

    def all_buckets(self) -> list[tuple[int, int]]:
        return sorted({self.bucket_for(t, 1) for t in self.t_buckets})

    # ---- forward ------------------------------------------------------------------------------
    def _forward_impl(self, params, kv_caches, input_ids, positions, md, logits_indices, inv_freq):
        return self.model.apply({"params": params}, input_ids, positions, kv_caches, md, logits_indices, inv_freq)

    def _arg_specs(self, t: int, s: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        md = AttentionMetadata(i32(t), i32(s), i32(s + 1), i32(s, self.max_blocks), i32(1))
        return i32(t), i32(t), md, i32(s)

    def compiled_forward(self, t: int, s: int):
        key = (t, s)
        fn = self._compiled.get(key)
        if fn is None:
            ids, pos, md, li = self._arg_specs(t, s)
            fn = self._forward.lower(self.params, self.kv_caches, ids, pos, md, li, self.inv_freq).compile()
            self._compiled[key] = fn
            self.num_compiles += 1
        return fn

    def precompile(self, progress=None) -> float:
        """Compile every (T, S) bucket now, so no request waits on a compile."""
        t0 = time.perf_counter()
        buckets = self.all_buckets()
        for i, (t, s) in enumerate(buckets):
            self.compiled_forward(t, s)
            if progress:
                progress(i + 1, len(buckets), (t, s))
        return time.perf_counter() - t0

    def execute(self, inputs: StepInputs, t: int, s: int, tensors: dict, mode: SamplingMode):
        """Run one step. Returns a SampleResult of device arrays (not yet synced)."""
        fwd = self.compiled_forward(t, s)
        md = AttentionMetadata(
            inputs.slot_mapping, inputs.seq_lens, inputs.query_start_loc, inputs.block_tables, inputs.num_seqs
        )
        ids, pos, md, li = meshlib.to_global(  # no-op in one process
            (inputs.input_ids, inputs.positions, md, inputs.logits_indices), self._replicated
        )
        logits, self.kv_caches = fwd(self.params, self.kv_caches, ids, pos, md, li, self.inv_freq)
        return self._sample(logits, meshlib.to_global(SamplingTensors(**tensors), self._replicated), mode)

    @staticmethod
    def fetch(result: SampleResult) -> tuple[np.ndarray, ...]:
        if jax.process_count() > 1:  # replicated over processes: read the local copy
            return tuple(meshlib.to_host(x) for x in result)
        return tuple(np.asarray(x) for x in jax.device_get(tuple(result)))

    def sampler_cache_size(self) -> int:
        return self._sample._cache_size()


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: str, tensor_parallel_size: int = 1) -> int:
    """KV bytes of one block on one device (kv heads split over tp, at least one head each)."""
    tp = tensor_parallel_size
    heads = max(model_cfg.num_kv_heads // tp, 1) if tp > 1 else model_cfg.num_kv_heads
    return 2 * model_cfg.num_layers * heads * model_cfg.head_dim * block_size * dtype_size(dtype)


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
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * memory_fraction)
    import psutil

    return int(min(psutil.virtual_memory().available * memory_fraction, 1 << 30))
