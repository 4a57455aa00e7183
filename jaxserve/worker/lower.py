"""`jaxserve lower`: export the engine's whole step for a GPU or TPU from a model config alone.

No device and no weights are needed: the parameters, KV cache and step inputs are
`jax.ShapeDtypeStruct`s with their shardings on a `jax.sharding.AbstractMesh` (so TP=8 lowers on
a one-CPU host), and each bucket's step is the runner's own (`ModelRunner.step_function`: forward,
KV write, attention, sampler) exported with `jax.export` for the target, with the attention
backend that platform would get. What this proves on CPU: every bucket traces and lowers for the
target, Pallas kernels included (Mosaic GPU / Mosaic TPU custom calls). What it cannot: the
target's compiler passes (ptxas, Mosaic's TPU layout passes), which only a device runs.

The memory plan is the engine's (`memory.plan_kv_memory`) with the device memory given on the
command line, the weights' bytes per device from their shapes and shardings, and the step's
temporaries from `memory.estimate_step_bytes` (XLA's memory analysis needs a compile for the
target, so it is estimated here; the engine measures it on the device).

`--compile` goes on to the target's own compiler (`runtime/deviceless.py`): the mesh is made of a
compile-only topology's devices (an H200 described by its GpuTargetConfigProto, a TPU v5e from
libtpu), every bucket is compiled, and each reports its compile seconds, the executable's
temporaries and, per Mosaic GPU kernel, ptxas' registers and spills with its shared memory. The
memory plan is then redone with the largest compiled temporaries in place of the estimate.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.args import engine_config
from jaxserve.config import EngineConfig
from jaxserve.core.buckets import BucketKey
from jaxserve.errors import UserError
from jaxserve.model import expert_padding, sharding
from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import CausalLM
from jaxserve.runtime import compat, deviceless, kv_sizing, memory, mxfp4
from jaxserve.runtime import mesh as meshlib
from jaxserve.runtime.attention import AttentionMetadata
from jaxserve.runtime.backend import Backend, KernelShape, resolve_backend
from jaxserve.runtime.moe import xla_gpu_dense_experts
from jaxserve.worker import runner as rt

GiB = memory.GiB
PLATFORMS = ("cuda", "tpu")
DEFAULT_DEVICE_MEMORY = {"cuda": 80 * GiB, "tpu": 16 * GiB}  # H100 / TPU v5e
DEFAULT_COMPUTE_CAPABILITY = "9.0"  # Hopper: what the Mosaic GPU kernels need
KERNEL_CALL = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}


def load_model_config(path: str) -> ModelConfig:
    """A model's ModelConfig from its HF directory or its config.json (no weights read)."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(f"Model config {path!r} not found: pass a Hugging Face model directory "
                        "holding config.json, or a config.json file.", param="model")
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{str(file)!r} is not a JSON model config ({e}): pass a model's "
                        "config.json.", param="model") from None
    if not isinstance(hf, dict):
        raise UserError(f"{str(file)!r} is not a model config: expected a JSON object.", param="model")
    try:
        return ModelConfig.from_hf(hf, source=str(file))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{str(file)!r} is not a complete model config ({type(e).__name__}: {e}): "
                        "pass the model's config.json.", param="model") from None


def param_shapes(mc: ModelConfig) -> dict:
    """{path: shape} of the model's parameters, from the model's own init (traced, not run)."""
    ops = Backend("cpu", "xla", "paged", False, False, "shapes").ops()
    model = CausalLM(mc, ops, jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    pages = jax.ShapeDtypeStruct((2, 16, mc.num_kv_heads, mc.head_dim), jnp.float32)
    md = AttentionMetadata(i32(1), i32(1), i32(2), i32(1, 1), i32(1))
    inv_freq = jax.ShapeDtypeStruct(mc.rope_inv_freq().shape, jnp.float32)
    init = jax.eval_shape(model.init, jax.random.key(0), i32(1), i32(1), [(pages, pages)] * mc.num_layers,
                          md, i32(1), inv_freq)
    return meshlib.shape_tree(init["params"])


class AbstractCheckpoint:
    """Weights that are only shapes: the runner "restores" them as ShapeDtypeStructs laid out on
    its mesh, through the same path as a lazy Orbax checkpoint."""

    def __init__(self, mc: ModelConfig):
        self._shapes = param_shapes(mc)

    def shapes(self) -> dict:
        return self._shapes

    def restore(self, shardings: dict, dtype) -> dict:
        return jax.tree.map(lambda shape, s: jax.ShapeDtypeStruct(shape, dtype, sharding=s), self._shapes,
                            shardings, is_leaf=lambda x: isinstance(x, tuple))


def abstract_packed_params(mc: ModelConfig, dtype) -> dict:
    """The weights as shapes with the routed experts in their packed checkpoint format (gpt-oss's
    MXFP4: `ModelConfig.expert_format`), as the loader keeps them: the runner places them through
    its quantized-weights path."""
    def leaf(path, shape):
        if path[-2] == "experts" and path[-1] in ("gate_proj", "up_proj", "down_proj"):
            e, k, n = shape
            return mxfp4.Mxfp4Weight(jax.ShapeDtypeStruct((e, n, k // mxfp4.BLOCK, mxfp4.BLOCK // 2), jnp.uint8),
                                     jax.ShapeDtypeStruct((e, n, k // mxfp4.BLOCK), jnp.uint8))
        return jax.ShapeDtypeStruct(shape, dtype)

    return meshlib.map_paths(param_shapes(mc), leaf)


class AbstractRunner(rt.ModelRunner):
    """A ModelRunner on an abstract mesh: params, KV caches and step inputs are shapes, nothing
    is allocated; `step_function` is the runner's own."""

    def _put(self, x: np.ndarray):
        return x  # stays a host constant / shape

    def _allocate_kv(self, num_blocks: int) -> rt.KVCaches:
        layers = jax.eval_shape(lambda: super(AbstractRunner, self)._allocate_kv(num_blocks).layers)
        return rt.KVCaches(layers, self.backend.kv_layout)


def weight_bytes_per_device(params) -> int:
    """Bytes of the (abstract) params on the device holding the most: each leaf's shard."""
    return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(params))


@dataclass(frozen=True)
class LoweredStep:
    key: BucketKey
    platform: str
    num_devices: int  # the exported module's partitions (the tensor parallel size)
    seconds: float
    module_bytes: int  # StableHLO text
    kernel_calls: int  # Pallas custom calls in it (one per layer with the pallas backend)

    def describe(self) -> str:
        k = self.key
        kind = (f" C={k.c}" if k.c else "") + (" decode" if k.decode else "")
        return (f"lowered T={k.t} S={k.s} W={k.w}{kind} for {self.platform} on {self.num_devices} device(s): "
                f"{self.kernel_calls} {KERNEL_CALL[self.platform]} calls, "
                f"{self.module_bytes / 1e6:.1f} MB StableHLO, {self.seconds:.1f} s")


@dataclass
class Lowering:
    """A model set up for lowering: the abstract runner, its backend and the memory plan."""

    platform: str
    model: ModelConfig
    runner: AbstractRunner
    plan: memory.MemoryPlan
    activation_key: BucketKey  # the bucket the activation estimate comes from
    total_weight_bytes: int
    estimate: Callable[[BucketKey], int]  # a bucket's temporaries by memory.estimate_step_bytes
    full_model: ModelConfig | None = None  # the model as configured, when `model` is a cut of it
    layers: tuple[int, ...] = ()  # the full model's layers the cut's layers are (cut_layers)

    def describe(self) -> list[str]:
        mc, r = self.model, self.runner
        full = self.full_model or mc
        cut = (f" (compiling {mc.num_layers}: layers {', '.join(map(str, self.layers))}; the plan is the "
               f"whole model's)" if full.num_layers != mc.num_layers else "")
        return [
            f"model: {mc.model_type}, {full.num_layers} layers{cut}, hidden {mc.hidden_size}, {mc.num_heads} q / "
            f"{mc.num_kv_heads} kv heads x {mc.head_dim}, vocab {mc.vocab_size}: "
            f"{_gib(self.total_weight_bytes)} of weights in {r.dtype.name}"
            + _experts(full, r.model_cfg, expert_padding.stacked_intermediate(r.params, r.model_cfg)),
            f"target: {self.platform}, tensor parallel {r.tensor_parallel_size} "
            f"({'abstract mesh' if isinstance(r.mesh, jax.sharding.AbstractMesh) else 'compile-only devices'}), "
            f"KV {r.kv_dtype.name}, {len(r.all_buckets())} buckets",
            r.backend.describe(),
            memory.summary(self.plan),
            f"activations: estimated for the largest bucket T={self.activation_key.t} "
            f"S={self.activation_key.s} (memory.estimate_step_bytes; the engine measures them on the device)",
        ]

    def export(self, key: BucketKey):
        """One bucket's step as a `jax.export.Exported` for the target platform."""
        jitted, args = self.runner.step_function(key)
        return compat.export(jitted, platforms=[self.platform])(*args)

    def compile(self, key: BucketKey):
        """One bucket compiled by the target's compiler (needs `prepare(devices=...)`): a
        `deviceless.CompileReport`."""
        jitted, args = self.runner.step_function(key)
        return deviceless.compile_report(lambda: jitted.lower(*args))

    def replan(self, activation_bytes: int) -> memory.MemoryPlan:
        """The memory plan again with `activation_bytes` (compiled temporaries) for the estimate."""
        p = self.plan
        return memory.plan_kv_memory(
            device_limit=p.device_limit, bytes_in_use=p.weight_bytes, activation_bytes=activation_bytes,
            block_bytes=p.block_bytes, block_size=p.block_size, max_model_len=p.max_model_len,
            utilization=p.utilization, margin_bytes=p.margin_bytes, tensor_parallel_size=p.tensor_parallel_size,
            reserved_blocks=p.reserved_blocks)

    def lower(self, key: BucketKey) -> LoweredStep:
        t0 = time.perf_counter()
        exported = self.export(key)
        text = exported.mlir_module()
        calls = len(re.findall(rf"{KERNEL_CALL[self.platform]}\w*", _custom_call_targets(text)))
        return LoweredStep(key, self.platform, exported.nr_devices, time.perf_counter() - t0, len(text), calls)


def _experts(full: ModelConfig, mc: ModelConfig, stacked: int | None = None) -> str:
    if not full.is_moe:
        return ""
    split = ("whole experts split over the model axis" if mc.expert_parallel
             else "each expert split on its intermediate axis")
    packed = ", experts in MXFP4 (4.25 bits per weight)" if mc.expert_format == "mxfp4" else ""
    i, size = full.moe_intermediate_size, stacked or mc.moe_intermediate_size
    unit = "MXFP4 blocks" if stacked is None else "panels / blocks of their format"
    if size != i:  # sharding.packed_intermediate (MXFP4), expert_padding.pad_expert_stacks (weight formats)
        packed += f", intermediate {i} padded to {size} for whole {unit} per device ({size / i:.2f}x; EP: unpadded)"
    return (f"; {len(full.moe_layers)} MoE layers of {mc.num_experts} experts, top {mc.num_experts_per_tok} "
            f"({split}{packed})")


def cut_layers(mc: ModelConfig, n: int) -> tuple[ModelConfig, tuple[int, ...]]:
    """`mc` cut to `n` layers for a quick compile of the same shapes, and which of its layers they
    are: one of each layer kind first (MoE or dense MLP; sliding window or global attention, as
    `layer_types` and `moe_layers` say), then the following layers in order. A cut that cannot hold
    both a dense and an MoE layer of a model that has both is refused (the plan needs each kind's
    weights)."""
    if n < 1:
        raise UserError(f"--num-layers {n}: pass at least 1.", param="num_layers")
    if n >= mc.num_layers:
        return mc, tuple(range(mc.num_layers))
    kinds = {}
    for i in range(mc.num_layers):
        kinds.setdefault((mc.is_moe_layer(i), mc.layer_window(i)), i)
    first = list(kinds.values())
    layers = tuple(sorted((first + [i for i in range(mc.num_layers) if i not in first])[:n]))
    mlps = {mc.is_moe_layer(i) for i in range(mc.num_layers)}
    if len({mc.is_moe_layer(i) for i in layers}) < len(mlps):
        raise UserError(f"--num-layers {n} cannot hold both of {mc.model_type}'s layer kinds (dense and MoE "
                        f"MLPs): pass --num-layers {len(mlps)} or more.", param="num_layers")
    cut = dataclasses.replace(
        mc, num_layers=n, moe_layers=tuple(k for k, i in enumerate(layers) if mc.is_moe_layer(i)),
        layer_types=tuple(mc.layer_types[i] for i in layers) if mc.layer_types else ())
    return cut, layers


def _leaves(tree, tuples: bool = True) -> list[tuple[tuple[str, ...], object]]:
    """(path of keys, leaf) of a params tree; `tuples`: shape tuples (and quantized weights) are leaves."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=(lambda x: isinstance(x, tuple)) if tuples else None)[0]
    return [(tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path), leaf) for path, leaf in flat]


def _whole_model(leaf_bytes: dict, full: ModelConfig, layers: tuple[int, ...]) -> int:
    """Bytes of the whole model from a cut's per-leaf bytes: the cut's layer of each kind stands for
    every full-model layer of that kind (same MLP kind, same parameter shapes)."""
    per_layer: dict[int, int] = {}
    rest = 0
    for path, n in leaf_bytes.items():
        if path and str(path[0]).startswith("layers_"):
            k = int(str(path[0]).removeprefix("layers_"))
            per_layer[k] = per_layer.get(k, 0) + n
        else:
            rest += n
    if len(layers) == full.num_layers:  # no cut: every layer as it is
        return rest + sum(per_layer.values())
    by_kind = {full.is_moe_layer(i): per_layer.get(k, 0) for k, i in enumerate(layers)}
    return rest + sum(by_kind[full.is_moe_layer(i)] for i in range(full.num_layers))


def full_weight_bytes(params, full: ModelConfig, layers: tuple[int, ...]) -> int:
    """Bytes per device (the device holding the most) of the whole model's weights, from the cut's
    placed params."""
    leaf_bytes = {}
    for i, (path, leaf) in enumerate(_leaves(params)):
        size = 0
        for a in jax.tree.leaves(leaf):
            size += int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        leaf_bytes[path + (i,)] = size
    return _whole_model(leaf_bytes, full, layers)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _custom_call_targets(text: str) -> str:
    """The custom-call target names of a StableHLO module, one per line."""
    return "\n".join(re.findall(r"custom_call @(\w+)", text) + re.findall(r'call_target_name = "(\w+)"', text))


def prepare(
    model: str,
    platform: str,
    config: EngineConfig,
    *,
    device_memory: int | None = None,
    compute_capability: str = DEFAULT_COMPUTE_CAPABILITY,
    devices: list | None = None,
    num_layers: int | None = None,
) -> Lowering:
    """The abstract runner for `model` on `platform` with `config`'s engine settings, and the memory
    plan for `device_memory` bytes per device; the KV cache is lowered at the planned size.
    `devices`: a compile-only topology's devices (runtime/deviceless.py) to lay the mesh out on,
    so the steps compile; without them the mesh is abstract and the steps only lower.
    `num_layers`: fewer layers than the model has (a quick compile of the same shapes)."""
    if platform not in PLATFORMS:
        raise UserError(f"Unknown platform {platform!r}: choose one of {', '.join(PLATFORMS)}.", param="platform")
    full = load_model_config(model)
    mc, layers = cut_layers(full, num_layers) if num_layers is not None else (full, tuple(range(full.num_layers)))
    tp = config.tensor_parallel_size
    sharding.check_layout(sharding.with_expert_parallel(mc, config.enable_expert_parallel), tp)
    dtype = config.dtype or "bfloat16"
    kv_dtype = config.kv_cache_dtype or kv_sizing.default_kv_cache_dtype(dtype, mc.checkpoint_dtype)
    shape = KernelShape(mc.head_dim, mc.num_heads // mc.num_kv_heads, config.block_size)
    backend = resolve_backend(config.attention_backend, dtype, kv_dtype, tp, shape, target=platform,
                              compute_capability=compute_capability)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    cfg = rt.RunnerConfig(
        block_size=config.block_size, num_blocks=2, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, dtype=dtype, tensor_parallel_size=tp,
        kv_cache_dtype=kv_dtype, quantization=None if config.quantization == "none" else config.quantization,
        enable_expert_parallel=config.enable_expert_parallel,
    )
    if devices is not None:
        mesh = jax.sharding.Mesh(np.array(devices[:tp]).reshape(1, tp), (meshlib.DATA, meshlib.MODEL))
    else:
        mesh = jax.sharding.AbstractMesh((1, tp), (meshlib.DATA, meshlib.MODEL))
    packed = mc.expert_format == "mxfp4"
    checkpoint = abstract_packed_params(mc, dtype) if packed else AbstractCheckpoint(mc)
    runner = AbstractRunner(mc, checkpoint, cfg, mesh=mesh, backend=backend)
    weights = full_weight_bytes(runner.params, full, layers)
    rc = runner.model_cfg  # kv heads as sharded (repeated when tp > kv heads)

    # packed experts take the blocked product (never XLA:GPU's dense expansion)
    dense_experts = 0 if packed else xla_gpu_dense_experts(platform, rc, tp, backend.gpu_moe_kernel, runner.dtype)

    def estimate(key: BucketKey) -> int:
        return memory.estimate_step_bytes(
            num_tokens=key.t, num_seqs=key.s, hidden_size=rc.hidden_size, intermediate_size=rc.intermediate_size,
            num_heads=rc.num_heads, num_kv_heads=rc.num_kv_heads, head_dim=rc.head_dim, vocab_size=rc.vocab_size,
            dtype_bytes=runner.dtype.itemsize, tensor_parallel_size=tp,
            num_experts_per_tok=rc.num_experts_per_tok if rc.is_moe else 0,
            moe_intermediate_size=expert_padding.stacked_intermediate(runner.params, rc) or rc.moe_intermediate_size,
            expert_parallel=rc.expert_parallel,
            dense_experts=dense_experts)

    largest = max(runner.all_buckets(), key=estimate)
    plan = memory.plan_kv_memory(
        device_limit=device_memory or DEFAULT_DEVICE_MEMORY[platform], bytes_in_use=weights,
        activation_bytes=estimate(largest),
        block_bytes=kv_sizing.kv_bytes_per_block(full, config.block_size, kv_dtype, tp, backend.kv_layout),
        block_size=config.block_size, max_model_len=max_model_len, utilization=config.gpu_memory_utilization,
        tensor_parallel_size=tp, reserved_blocks=1,
    )
    runner.resize_kv(plan.num_blocks)  # per layer: the whole model's KV cache, whatever the cut
    if packed:  # packed experts count their bytes as stored
        leaf_bytes = {p: int(np.prod(a.shape)) * (a.dtype.itemsize if a.dtype == jnp.uint8 else runner.dtype.itemsize)
                      for p, a in _leaves(checkpoint, tuples=False)}
    else:
        leaf_bytes = {p: int(np.prod(shape)) * runner.dtype.itemsize for p, shape in _leaves(checkpoint.shapes())}
    total = _whole_model(leaf_bytes, full, layers)
    return Lowering(platform, mc, runner, plan, largest, total, estimate, full, layers)


def run(args, out: Callable[[str], None] = print) -> int:
    """The `jaxserve lower` command: the plan, then one line per bucket lowered (or compiled)."""
    config = engine_config(args)
    if getattr(args, "compile", False):
        from jaxserve.worker import compile_cmd

        return compile_cmd.run(args, config, out)
    if getattr(args, "target", None):
        raise UserError("--target names the device --compile compiles for: add --compile.", param="target")
    lowering = prepare(args.model, args.platform, config, device_memory=args.device_memory,
                       compute_capability=args.compute_capability)
    for line in lowering.describe():
        out(line)
    t0 = time.perf_counter()
    keys = sorted(lowering.runner.all_buckets())
    for key in keys:
        try:
            step = lowering.lower(key)
        except Exception as e:  # a bucket that does not lower: say which, and why, in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"lowering bucket T={key.t} S={key.s} W={key.w} C={key.c} for {args.platform} failed: "
                            f"{type(e).__name__}: {first}") from e
        out(step.describe())
    out(f"lowered {len(keys)} buckets for {args.platform} in {time.perf_counter() - t0:.1f} s")
    return 0
