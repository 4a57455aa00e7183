"""The device side of a step: weights and per-layer KV arrays on devices, and per bucket an
ahead-of-time compiled step: the bucket's forward (logits rows) and the sampler executable shared
by every bucket of the same rows (worker/bucket_step.py).

    StepBatch.pack() -> i32 buffer -> step[BucketKey](params, kv, head, tail, last_tokens)
        -> (StepResult, kv)   # kv donated: updated in place

Steps live in a dict keyed by `BucketKey`, so a steady-state step can never silently
recompile: `num_compiles` only grows when a new bucket is met (and `precompile` meets them all).
The previous step's sampled tokens stay on the device (`last_tokens`, i32[s_max]); a row whose
last token is still pending on the host reads it from there (`StepBatch.prev_index`), which lets
the engine dispatch step n+1 before it has read step n.

Tensor parallelism (`tensor_parallel_size` > 1): params, KV caches and the executables are laid
out on a ("data", "model") mesh (`jaxserve.runtime.mesh`) in `jaxserve.model.sharding`'s layouts;
the batch, logits and sampled tokens are replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import SAMPLER_FIELDS, BatchBuilder, StepBatch
from jaxserve.core.buckets import BucketKey
from jaxserve.model import sharding
from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import CausalLM
from jaxserve.runtime import compat, fallback, huge_pages, sharded_ops
from jaxserve.runtime import mesh as meshlib
from jaxserve.runtime.attention import AttentionMetadata
from jaxserve.runtime.backend import Backend, KernelShape, resolve_backend
from jaxserve.runtime.kv_sizing import kv_block_shape, kv_storage_dtype
from jaxserve.runtime.sampler import sample
from jaxserve.startup_trace import mark
from jaxserve.worker import placement, step_cache, xla_cache
from jaxserve.worker.bucket_step import BucketStep, StepResult, fetch_result, unpack_batch
from pallas_kernels import kv_quant

log = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str | None = None  # None: the best that runs here (backend.resolve_backend)
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    kv_cache_dtype: str | None = None  # default: dtype
    quantization: str | None = None  # int8, q8_0, ...: float weights quantized here (runtime/quant_params.py)
    enable_expert_parallel: bool = False  # MoE: split whole experts over the model axis (model/sharding.py)


class KVCaches(NamedTuple):
    """Per-layer (k_pages, v_pages), with the layout they hold (backend.KV_LAYOUTS); pages are
    arrays, or kv_quant.QuantPages (data + per-(token, head) scales) for a quantized cache."""

    layers: list
    layout: str


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params, cfg: RunnerConfig, mesh=None, backend: Backend | None = None):
        """params: a numpy tree (placed shard by shard) or a lazy checkpoint with
        `restore(shardings, dtype)` (an Orbax checkpoint, restored straight onto the mesh)."""
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.dtype)
        # The KV cache's name (a dtype, or a quantized format: pallas_kernels/kv_quant.py) and the
        # dtype its data is stored in.
        self.kv_cache_dtype = cfg.kv_cache_dtype or cfg.dtype
        self.kv_dtype = kv_storage_dtype(self.kv_cache_dtype)
        self.mesh = mesh if mesh is not None else meshlib.make_mesh(cfg.tensor_parallel_size)
        tp = meshlib.tp_size(self.mesh)
        model_cfg = sharding.with_expert_parallel(model_cfg, cfg.enable_expert_parallel)
        shape = KernelShape(model_cfg.head_dim, model_cfg.num_heads // model_cfg.num_kv_heads, cfg.block_size)
        backend = backend or resolve_backend(cfg.attention_backend, cfg.dtype, self.kv_cache_dtype, tp, shape)
        self.backend = dataclasses.replace(backend, bf16_compute=cfg.quantization == "bfloat16")
        log.info(self.backend.describe())
        mark("backend (native kernels)")
        self.source_config = model_cfg
        # With tp > num_kv_heads each kv head is repeated so every device holds one (see mesh.py).
        self.model_cfg = model_cfg = sharding.sharded_config(model_cfg, tp)
        self.kv_repeat = sharding.kv_replication(self.source_config, tp)
        self.params, self.param_shardings = placement.place_params(
            params, self.source_config, model_cfg, self.mesh, cfg.quantization, self.dtype, self.kv_repeat)
        self._replicated = meshlib.replicated(self.mesh)
        if self.backend.native_linear:
            self.params = self.backend.prepare_params(self.params, model_cfg.tie_word_embeddings)
            self.param_shardings = jax.tree.map(lambda _: self._replicated, self.params)
        mark("weights placed")
        self.inv_freq = self._put(np.asarray(model_cfg.rope_inv_freq(), np.float32))
        self.builder = BatchBuilder(
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            block_size=cfg.block_size, max_model_len=cfg.max_model_len, vocab_size=model_cfg.vocab_size,
        )
        self._use_backend(self.backend)
        self.max_blocks = self.builder.max_blocks
        self.s_max = self.builder.s_max
        self.last_tokens = self._put(np.zeros(self.s_max, np.int32))
        self._argmax = self.backend.argmax()
        self._jitted: dict[BucketKey, object] = {}  # forward_logits
        self._compiled: dict[BucketKey, BucketStep] = {}
        self._samplers: dict[BucketKey, Future] = {}  # by BucketKey.sampler(): shared by buckets
        self._samplers_lock = threading.Lock()
        self.num_compiles = 0
        self.steps_run = 0  # steps dispatched: the KV cache holds data once one has run
        self._generation = 0  # bumped when the attention backend falls back (fallback.py)
        self._fallback_lock = threading.Lock()
        mark("kv cache")

    def _use_backend(self, backend: Backend, allocate: bool = True) -> None:
        """The attention backend's models (one per attention variant, same params: decode-only
        buckets get the decode kernel), KV layout and shardings, and a KV cache in that layout
        (where `allocate`: not while a device's buckets compile before their cache, resize_kv)."""
        self.backend = backend
        # the bucket dimensions the backend asks for (the engine's planner shares this builder)
        self.builder.decode_buckets = backend.has_decode_kernel
        self.builder.context_buckets = backend.context_buckets
        self.builder.set_token_midpoints(backend.token_midpoints)
        self.models = {d: CausalLM(self.model_cfg, self._ops(d), self.dtype) for d in (False, True)}
        self.model = self.models[False]
        quantized = kv_quant.is_quantized(self.kv_cache_dtype)
        self.page_sharding = meshlib.kv_cache_sharding(self.mesh, backend.kv_layout, quantized)
        # quantized pages are (data, scale) pytrees: their two shardings per array (tpu-fused: one
        # array, (pages, None)); else one for all
        v_sharding = None if backend.kv_layout == "tpu-fused" else self.page_sharding
        self.kv_sharding = ([(self.page_sharding, v_sharding)] * self.model_cfg.num_layers if quantized
                            else self.page_sharding)
        self.kv = None  # free the old arrays first
        self._kv_spec = None
        if allocate:
            self.allocate_kv()

    def _ops(self, decode_only: bool):
        ops = self.backend.ops(lambda attend: sharded_ops.shard_attention(attend, self.mesh, self.backend.kv_layout),
                               decode_only=decode_only)
        return dataclasses.replace(ops, moe=sharded_ops.shard_moe(ops.moe, self.mesh, self.model_cfg.expert_parallel))

    def _put(self, x: np.ndarray):
        """A small host array, replicated over the mesh (lower.AbstractRunner keeps it on the host)."""
        return jax.device_put(x, self._replicated)

    def _allocate_kv(self, num_blocks: int) -> KVCaches:
        mc, layout = self.model_cfg, self.backend.kv_layout
        shape = (num_blocks, *kv_block_shape(layout, self.cfg.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype))
        zeros = jax.jit(lambda: kv_quant.empty(shape, self.kv_cache_dtype), out_shardings=self.page_sharding)
        if layout == "tpu-fused":  # one array per layer holds K and V
            return KVCaches([(zeros(), None) for _ in range(mc.num_layers)], layout)
        return KVCaches([(zeros(), zeros()) for _ in range(mc.num_layers)], layout)

    def resize_kv(self, num_blocks: int, allocate: bool = True) -> None:
        """Size the KV cache at num_blocks blocks (after memory sizing); executables compiled for
        the old size are dropped. allocate=False frees the cache and leaves it to allocate_kv():
        steps compile against its shapes (kv_spec) meanwhile, so on a device every bucket compiles
        while the memory the cache will take is still free (XLA's autotuner allocates from it)."""
        self.kv = None  # free the old arrays first
        self.cfg = dataclasses.replace(self.cfg, num_blocks=num_blocks)
        self._kv_spec = None
        self.drop_executables()
        self.num_compiles = 0
        if allocate:
            self.allocate_kv()

    def allocate_kv(self) -> None:
        """The KV cache's arrays at the configured size (a no-op when they exist)."""
        if self.kv is None:
            self.kv = self._allocate_kv(self.cfg.num_blocks)
            moved = huge_pages.back_zeroed_with_huge_pages(jax.tree.leaves(self.kv.layers))
            if moved:
                log.info("KV cache: %d MiB on 2 MiB pages", moved >> 20)

    def kv_spec(self) -> list:
        """The KV cache's per-layer arrays as shapes (the jitted steps carry their shardings): what
        every step compiles against, whether or not the cache is allocated yet."""
        if self._kv_spec is None:
            self._kv_spec = jax.eval_shape(lambda: ModelRunner._allocate_kv(self, self.cfg.num_blocks).layers)
        return self._kv_spec

    def drop_executables(self) -> None:
        """Forget every compiled step and sampler (a new KV size or attention backend)."""
        self._compiled.clear()
        self._jitted.clear()
        self._samplers.clear()

    def peak_step_bytes(self) -> int:
        """Peak temporary bytes of the largest bucket's executable (XLA's memory analysis)."""
        return compat.peak_temp_bytes(self.executable(max(self.all_buckets())))

    @property
    def tensor_parallel_size(self) -> int:
        return meshlib.tp_size(self.mesh)

    @property
    def kv_caches(self) -> list:
        return self.kv.layers

    # ---- shapes -------------------------------------------------------------------------------
    def all_buckets(self) -> list[BucketKey]:
        return self.builder.all_buckets()

    # ---- the step -----------------------------------------------------------------------------
    def _forward(self, params, layers, b: StepBatch, last_tokens, decode: bool = False, hidden: bool = False):
        ids = jnp.where(b.prev_index >= 0, last_tokens[jnp.maximum(b.prev_index, 0)], b.input_ids)
        md = AttentionMetadata(b.slot_mapping, b.seq_lens, b.query_start_loc, b.block_tables, b.num_seqs)
        return self.models[decode].apply({"params": params}, ids, b.positions, layers, md, b.logits_indices,
                                         self.inv_freq, b.num_logits, return_hidden=hidden)

    def _forward_impl(self, params, layers, flat, last_tokens, key: BucketKey):
        b = unpack_batch(flat, self.builder.field_specs(key)[:SAMPLER_FIELDS])
        out, layers = self._forward(params, layers, b, last_tokens, key.decode, key.pool)
        logits, hidden = out if key.pool else (out, None)
        if self.tensor_parallel_size > 1:  # sample on every device alike: no collectives in the sampler
            logits = jax.lax.with_sharding_constraint(logits, self._replicated)
        return (logits, hidden), layers

    def _sample_impl(self, logits, flat, key: BucketKey) -> StepResult:
        b = unpack_batch(flat, self.builder.field_specs(key)[SAMPLER_FIELDS:])
        r = sample(logits, b, self._argmax, adjust=key.w > 0, keep_topk=self.tensor_parallel_size == 1)
        tokens = jnp.zeros((self.s_max,), jnp.int32).at[: key.s].set(r.tokens)
        return StepResult(tokens, *r[1:])

    def _jit_forward(self, key: BucketKey):
        rep, kv = self._replicated, self.kv_sharding
        return jax.jit(lambda p, layers, flat, last: self._forward_impl(p, layers, flat, last, key),
                       donate_argnums=(1,), in_shardings=(self.param_shardings, kv, rep, rep),
                       out_shardings=(rep, kv))

    def _jit_sampler(self, key: BucketKey):
        rep = self._replicated
        return jax.jit(lambda logits, flat: self._sample_impl(logits, flat, key), in_shardings=(rep, rep),
                       out_shardings=rep)

    def _forward_size(self, key: BucketKey) -> int:
        """int32 words of the packed buffer's head, the forward's fields (the tail is the sampler's)."""
        return sum(int(np.prod(shape)) for _, shape, _ in self.builder.field_specs(key)[:SAMPLER_FIELDS])

    @staticmethod
    def _flat(size: int):
        return jax.ShapeDtypeStruct((size,), jnp.int32)

    def step_function(self, key: BucketKey) -> tuple[object, tuple]:
        """One bucket's step as one jitted function of the whole packed buffer (its forward, then
        its sampler) and its arguments: what `worker/lower.py` exports and compiles for another
        platform. The runner itself compiles the two parts apart (`_compile`)."""
        n, sk = self._forward_size(key), key.sampler()
        forward, sampler = self._jit_forward(key), self._jit_sampler(sk)

        def step(p, layers, flat, last):
            (logits, hidden), layers = forward(p, layers, flat[:n], last)
            return sampler(logits, flat[n:])._replace(hidden=hidden), layers

        rep, kv = self._replicated, self.kv_sharding
        jitted = jax.jit(step, donate_argnums=(1,), in_shardings=(self.param_shardings, kv, rep, rep),
                         out_shardings=(rep, kv))
        return jitted, (self.params, self.kv_spec(), self._flat(self.builder.packed_size(key)), self.last_tokens)

    def _compile_part(self, key: BucketKey, jitted, args):
        """One executable, from the step cache (serialized, keyed by what its trace depends on) or
        compiled; the sampler's key has T = 0, so the two never share a file."""
        cache_key = step_cache.key_for(self, key)  # None when the step cache is off
        exe = step_cache.load(cache_key)
        if exe is None:
            exe = step_cache.compile(cache_key, jitted.lower(*args))
        return exe

    def _sampler(self, key: BucketKey):
        """The sampler executable for `key`'s rows, compiled once (concurrent buckets wait for it)."""
        sk = key.sampler()
        with self._samplers_lock:
            pending = self._samplers.get(sk)
            mine = pending is None
            if mine:
                pending = self._samplers[sk] = Future()
        if mine:
            try:
                logits = jax.ShapeDtypeStruct((sk.s, self.model_cfg.vocab_size), jnp.float32)
                tail = self._flat(self.builder.packed_size(sk) - self._forward_size(sk))
                pending.set_result(self._compile_part(sk, self._jit_sampler(sk), (logits, tail)))
            except BaseException as e:
                with self._samplers_lock:
                    self._samplers.pop(sk, None)
                pending.set_exception(e)
        return pending.result()

    def _compile(self, key: BucketKey) -> BucketStep:
        """The bucket's step; a default Pallas backend the compiler rejects falls back to `xla`
        once (warned) and the bucket compiles again."""
        generation = self._generation
        t0 = time.perf_counter()
        try:
            n = self._forward_size(key)
            args = (self.params, self.kv_spec(), self._flat(n), self.last_tokens)
            forward = self._compile_part(key, self._jit_forward(key), args)
            step = BucketStep(forward, self._sampler(key), n)
            mark("compile", bucket=list(key), s=time.perf_counter() - t0)
            return step
        except Exception as e:  # noqa: BLE001 - any compiler error; re-raised unless we fall back
            if not fallback.fall_back(self, generation, e):
                raise
        return self._compile(key)

    def executables(self) -> list:
        """Every compiled executable once (each bucket's forward, each shared sampler)."""
        samplers = [f.result() for f in list(self._samplers.values()) if f.done() and not f.exception()]
        return [step.forward for step in self._compiled.values()] + samplers

    def executable(self, key: BucketKey):
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._compile(key)
            self.num_compiles += 1
        return fn

    def precompile(self, progress=None, workers: int | None = None, keys: list[BucketKey] | None = None) -> float:
        """Compile every bucket (or `keys`) now, so no request waits on a compile: in parallel,
        one XLA compile per core (compiling releases the GIL), largest first."""
        t0 = time.perf_counter()
        every = keys is None
        hits0, misses0 = xla_cache.EVENTS.values()
        # a backend fallback drops what was compiled before it (and may change the bucket set:
        # xla's context widths): the loop compiles what is missing
        while True:
            keys = self.all_buckets() if every else keys
            todo = [k for k in sorted(keys, reverse=True) if k not in self._compiled]
            if not todo:
                break
            generation = self._generation
            with ThreadPoolExecutor(max_workers=workers or min(len(todo), os.cpu_count() or 1)) as pool:
                futures = {pool.submit(self._compile, k): k for k in todo}
                for f in as_completed(futures):
                    exe = f.result()
                    if self._generation == generation:
                        self._compiled[futures[f]] = exe
                        self.num_compiles += 1
                        if progress:
                            progress(sum(k in self._compiled for k in keys), len(keys), futures[f])
        hits, misses = (n - n0 for n, n0 in zip(xla_cache.EVENTS.values(), (hits0, misses0)))
        cache = jax.config.jax_compilation_cache_dir
        if cache and misses and hits + misses:  # a cold or damaged cache costs minutes: say so
            log.warning("%d of %d step executables were compiled (not found in, or not readable from, the "
                        "XLA compilation cache at %s); %d were loaded from it", misses, hits + misses, cache, hits)
        return time.perf_counter() - t0

    def execute(self, batch: StepBatch | np.ndarray, key: BucketKey) -> StepResult:
        """Dispatch one step (returns at once: device arrays, not synced). `batch` may already be
        packed (multi-host followers receive the buffer)."""
        fn = self.executable(key)
        if self.kv is None:
            raise RuntimeError("the KV cache is not allocated yet: allocate_kv() after resize_kv(n, allocate=False)")
        flat = batch.pack() if isinstance(batch, StepBatch) else batch
        head, tail = (meshlib.to_global(x, self._replicated) for x in (flat[:fn.split], flat[fn.split:]))
        result, layers = fn(self.params, self.kv.layers, head, tail, self.last_tokens)
        self.kv = KVCaches(layers, self.kv.layout)
        self.steps_run += 1
        self.last_tokens = result.tokens
        return result

    fetch = staticmethod(fetch_result)  # the step's tokens (and what was asked) on the host

    # ---- for tests and tools: logits of a batch, no sampling ------------------------------------
    def forward_logits(self, batch: StepBatch, key: BucketKey):
        """Raw logits f32[S, V] of a batch, through a separate (lazily jitted) forward."""
        fn = self._jitted.get(key)
        if fn is None:
            def f(p, layers, flat, last):
                return self._forward(p, layers, unpack_batch(flat, self.builder.field_specs(key)), last, key.decode)

            rep, kv = self._replicated, self.kv_sharding
            fn = self._jitted[key] = jax.jit(f, donate_argnums=(1,), in_shardings=(self.param_shardings, kv, rep, rep),
                                             out_shardings=(rep, kv))
        flat = meshlib.to_global(batch.pack(), self._replicated)
        logits, layers = fn(self.params, self.kv.layers, flat, self.last_tokens)
        self.kv = KVCaches(layers, self.kv.layout)
        return logits
