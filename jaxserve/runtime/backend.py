"""The backend: every device-side choice, made once when the engine is built.

`resolve_backend` decides the platform, the attention implementation, the KV layout and whether
the linear layers, the tied LM head and greedy argmax run natively; native libraries are built
here, never inside a trace. The model never sees a flag: it receives `ModelOps`, the callables
it needs, and weights carry their own format (a float array, or `PackedWeight` panels for the
native CPU matmul), so each op dispatches on what it is given, not on a setting.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.config import DTYPES
from jaxserve.errors import UserError
from jaxserve.runtime import compat, cpu_kernels, expert_matmul, mxfp4, quant
from jaxserve.runtime.attention import layer_attention
from jaxserve.runtime.moe import blocked_ragged_dot, gpu_ragged_dot, grouped_experts, pallas_ragged_dot
from jaxserve.runtime.mxfp4 import Mxfp4Panels, Mxfp4Weight
from jaxserve.runtime.panels import PANEL
from jaxserve.runtime.row_fusion import unfused
from jaxserve.runtime.weight_formats import ExpertStack
from jaxserve.runtime.sampler import greedy_argmax
from pallas_kernels import kv_quant

log = logging.getLogger("jaxserve")

ATTENTION_BACKENDS = ("cpu", "xla", "pallas")
# [nb, bs, Hkv, D] | K blocks [Hkv, D, bs], V blocks [Hkv, bs, D] | one array [nb, 2 * Hkv, bs, D
# padded to 128] per layer, K and V of head h at rows 2h and 2h + 1 (pallas_kernels/tpu.py)
KV_LAYOUTS = ("paged", "cpu-tiled", "tpu-fused")


class PackedWeight(NamedTuple):
    """A linear layer's [K, N] kernel as 64-column panels [N/64, K, 64] (csrc/matmul.cc)."""

    panels: jax.Array


def _dot_linear(x, w, num_rows=None):
    return jnp.dot(x, w.astype(x.dtype))


def _dot_gated(linear):
    def gated(x, w_gate, w_up, num_rows=None):
        return jax.nn.silu(linear(x, w_gate, num_rows)) * linear(x, w_up, num_rows)

    return gated


def _embed_lookup(table, ids):
    if isinstance(table, PackedWeight):  # the tied table held as LM-head panels [V/64, H, 64]
        return table.panels[ids // cpu_kernels.PANEL, :, ids % cpu_kernels.PANEL]
    return jnp.take(table, ids, axis=0)


@dataclass(frozen=True)
class ModelOps:
    """What the model calls. `linear(x, w, num_rows, norm=None, residual=None)`: num_rows (i32[1])
    are the step's real rows, all that a native kernel computes; `norm` (a RowNorm) applied to x's
    rows first and `residual` added to the product (runtime/row_fusion.py: fused into the native
    dot-product matmul's rows, else XLA ops); `gated(x, w_gate, w_up, num_rows, norm=None)`;
    `lm_head(x, table, num_rows)` is a tied embedding's transpose product; `attention(q, k, v,
    k_pages, v_pages, md, **kw) -> (out, k_pages, v_pages)` writes this step's K/V and attends;
    `moe(x, ids, weights, w_gate, w_up, w_down, num_rows)` runs the routed experts (runtime/moe.py),
    wrapped per device under tensor / expert parallelism."""

    linear: Callable
    gated: Callable  # silu(x @ W_gate) * (x @ W_up)
    embed: Callable
    lm_head: Callable
    attention: Callable
    moe: Callable = grouped_experts


@dataclass(frozen=True)
class Backend:
    platform: str  # cpu | gpu | tpu
    attention: str  # cpu | xla | pallas
    kv_layout: str
    native_linear: bool  # packed float32 matmul (csrc/matmul.cc)
    native_argmax: bool
    reason: str  # why this was chosen (logged once)
    # the attention backend to serve with if this one's kernels fail to compile on the device
    # (runtime/fallback.py): `xla` for the default Pallas on GPU/TPU; None where it was requested
    fallback: str | None = None
    # the instructions of the dot-product formats' native kernel (csrc/dot_matmul.cc), chosen here
    # once ($JAXSERVE_CPU_ISA read then) and passed to every call; None off the native CPU kernels
    dot_isa: cpu_kernels.DotIsa | None = None
    # an NVIDIA Hopper GPU (sm_90a): the MoE experts' grouped matmul runs the Mosaic GPU kernel
    # (pallas_kernels/gpu_gmm.py) where the Pallas backend is chosen (its fallback takes XLA's ragged_dot)
    hopper: bool = False
    # the model computes in bfloat16 (--quantization bfloat16): only then do bfloat16 KV
    # pages' attention products take AVX-512 BF16 dot products (q and the probabilities rounded to
    # bfloat16 as the matmuls' inputs already are); float32 compute keeps float32 attention (set by
    # the runner, which knows the weights)
    bf16_compute: bool = False

    def describe(self) -> str:
        linear = "XLA dot"
        if self.native_linear:
            paths = cpu_kernels.kernel_paths(self.dot_isa)
            linear = (f"native packed matmul (bfloat16: {paths.get('bfloat16')}, w8a8: {paths.get('w8a8')}, "
                      f"w4a8: {paths.get('w4a8')})")
        attention = self.attention + (" (bfloat16 pages: avx512_bf16 dot products)" if self.attention_isa else "")
        return (f"backend: platform={self.platform} attention={attention} kv_layout={self.kv_layout} "
                f"linear={linear} argmax={'native' if self.native_argmax else 'XLA'} ({self.reason})")

    @property
    def attention_isa(self) -> int:
        """The native CPU attention's attribute isa (cpu_kernels.attention_isa) where the model
        computes in bfloat16; 0 otherwise and off the native attention."""
        native = self.dot_isa and self.attention == "cpu" and self.bf16_compute
        return cpu_kernels.attention_isa(self.dot_isa) if native else 0

    @property
    def gpu_moe_kernel(self) -> bool:
        """The routed experts through the Mosaic GPU grouped matmul (runtime/moe.gpu_ragged_dot)."""
        return self.platform == "gpu" and self.hopper and self.attention == "pallas"

    @property
    def has_decode_kernel(self) -> bool:
        """A kernel of its own for steps whose every row is one decode token: split-KV on GPU, the
        TPU kernel's decode block sizes (one sequence per grid step) on TPU."""
        return self.attention == "pallas" and self.platform in ("gpu", "tpu")

    @property
    def context_buckets(self) -> bool:
        """The block table's width is a bucket dimension (`BucketKey.c`): the `xla` path's loops
        and gathers span the table it is given, so a step of short contexts gets a narrow table
        instead of max_model_len's. The native CPU kernel and the Pallas kernels walk only each
        sequence's own blocks: they keep one full width (and their buckets)."""
        return self.attention == "xla"

    @property
    def token_midpoints(self) -> bool:
        """Token buckets at the 1.5x midpoints too (core/buckets.token_buckets). Not where the
        linear layers, LM head and attention are native CPU kernels: they compute only a step's real
        rows, so padding to the next power of two costs little there, while each bucket held costs
        ~35 MiB of resident executable and its compile (bench/RESULTS.md, issue 26 scope 5)."""
        return not (self.native_linear and self.attention == "cpu")

    def ops(self, attention_wrapper: Callable = lambda f: f, decode_only: bool = False) -> ModelOps:
        """The model's ops; each also takes weights in runtime/weight_formats.py's formats (runtime/quant.py;
        routed experts kept in one: runtime/expert_matmul.py).

        ``decode_only``: ops for a step whose every row is one decode token (token t is sequence
        t), where the pallas backend runs the split-KV decode kernel on GPU."""
        ops = quant.quantized_ops(self._float_ops(attention_wrapper, decode_only), self.native_linear, self.dot_isa)
        return dataclasses.replace(ops, moe=expert_matmul.packed_moe(ops.moe, self.native_experts, self.dot_isa))

    @property
    def native_experts(self) -> bool:
        """Experts kept in a weight format run in the native grouped kernels: wherever the native CPU
        kernels are built, under tensor / expert parallelism too (the MoE runs per device under
        shard_map, each call on its own shard: sharded_ops.shard_moe), unlike the dense linear layers,
        which XLA partitions there."""
        return self.native_linear or (self.platform == "cpu" and self.attention == "cpu")

    def _float_ops(self, attention_wrapper: Callable, decode_only: bool = False) -> ModelOps:
        attend = attention_wrapper(layer_attention(self.attention, self.platform, decode_only, self.kv_layout,
                                                   self.attention_isa))
        # XLA:CPU expands ragged_dot into a product over every expert: tiles there; TPU: the Pallas
        # grouped matmul (runtime/moe.py, pallas_kernels/tpu_gmm.py); cuda: the Mosaic GPU one
        # (pallas_kernels/gpu_gmm.py; XLA:GPU makes ragged_dot a dense product over every expert)
        matmul = {"cpu": blocked_ragged_dot, "tpu": pallas_ragged_dot}.get(self.platform)
        if self.gpu_moe_kernel:
            matmul = gpu_ragged_dot
        moe = functools.partial(grouped_experts, matmul=matmul) if matmul else grouped_experts
        if not self.native_linear:
            return ModelOps(unfused(_dot_linear), unfused(_dot_gated(_dot_linear)), _embed_lookup,
                            lambda x, table, rows=None: jnp.dot(x, table.T.astype(x.dtype)), attend, moe)
        def linear(x, w, num_rows=None):
            if isinstance(w, PackedWeight):
                return cpu_kernels.cpu_matmul(x.astype(jnp.float32), w.panels, num_rows)
            return _dot_linear(x, w)

        def gated(x, w_gate, w_up, num_rows=None):
            if isinstance(w_gate, PackedWeight) and isinstance(w_up, PackedWeight):
                return cpu_kernels.cpu_matmul_gated(x.astype(jnp.float32), w_gate.panels, w_up.panels, num_rows)
            return _dot_gated(linear)(x, w_gate, w_up, num_rows)

        def lm_head(x, table, num_rows=None):
            if isinstance(table, PackedWeight):
                return cpu_kernels.cpu_matmul(x.astype(jnp.float32), table.panels, num_rows)
            return jnp.dot(x, table.T.astype(x.dtype))

        return ModelOps(unfused(linear), unfused(gated), _embed_lookup, lm_head, attend, moe)

    def argmax(self) -> Callable:
        if self.native_argmax:
            return cpu_kernels.argmax_rows
        return greedy_argmax

    def prepare_params(self, params: dict, tied_embeddings: bool) -> dict:
        """Weights in the formats this backend's ops read: packed panels for the native matmul
        (every linear kernel whose N is a multiple of 64, and a tied embedding as its transpose), and
        MXFP4 experts in the panels of their native kernel (the same bytes: runtime/mxfp4.py)."""
        if not self.native_linear:
            return params
        def pack(path, leaf):
            if isinstance(leaf, Mxfp4Weight):
                if leaf.shape[2] % PANEL:
                    return leaf
                return ExpertStack(Mxfp4Panels(*(jnp.asarray(a) for a in mxfp4.stack_panels(leaf))))
            names = [getattr(k, "key", None) for k in path]
            if names[-1] == "kernel" and cpu_kernels.packable(leaf.shape):
                return PackedWeight(cpu_kernels.pack_kernel(leaf))
            if tied_embeddings and names[-2:] == ["embed_tokens", "embedding"] and cpu_kernels.packable(leaf.T.shape):
                return PackedWeight(cpu_kernels.pack_kernel(leaf.T))
            return leaf

        return jax.tree_util.tree_map_with_path(pack, params, is_leaf=lambda x: isinstance(x, Mxfp4Weight))


@dataclass(frozen=True)
class KernelShape:
    """What decides whether a Pallas kernel runs a model: its attention shape per device."""

    head_dim: int
    group: int  # query heads per kv head
    block_size: int


def resolve_backend(requested: str | None, dtype: str, kv_dtype: str, tensor_parallel_size: int = 1,
                    shape: KernelShape | None = None, *, target: str | None = None,
                    compute_capability: str | None = None) -> Backend:
    """Decide once what runs. An explicit choice that cannot run is a UserError naming the fix;
    the default picks the best that runs here and says why.

    ``target`` (``cuda``/``gpu``/``tpu``) decides for that platform instead of this host's, with
    ``compute_capability`` standing in for the GPU's: what `jaxserve lower` exports for."""
    if kv_dtype not in DTYPES and not kv_quant.is_quantized(kv_dtype):
        raise UserError(f"Unknown KV cache dtype {kv_dtype!r}: choose one of "
                        f"{', '.join(DTYPES + tuple(kv_quant.KV_QUANT_DTYPES))}.", param="kv_cache_dtype")
    platform = target or jax.default_backend()
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if target is None:
        compute_capability = compat.compute_capability(jax.devices()[0])
        if platform == "cpu":
            compat.warn_if_accelerator_unused(platform="cpu")
    if requested is not None and requested not in ATTENTION_BACKENDS:
        raise UserError(f"Unknown attention backend {requested!r}: choose one of {', '.join(ATTENTION_BACKENDS)}.",
                        param="attention_backend")
    if platform != "cpu":
        if requested == "cpu":
            raise UserError(f"Attention backend 'cpu' runs on CPU only, not on {platform}: use pallas or xla.",
                            param="attention_backend")
        name = requested or "pallas"
        reason = "requested" if requested else f"default on {platform}"
        if name == "pallas" and shape is not None:
            # Quantized pages are widened to the compute dtype inside the kernel.
            why = pallas_kernels.supported(
                platform, dtype=dtype if kv_quant.is_quantized(kv_dtype) else kv_dtype, head_dim=shape.head_dim,
                group=shape.group, block_size=shape.block_size,
                compute_capability=compute_capability, kv_dtype=kv_quant.KV_QUANT_DTYPES.get(kv_dtype))
            if not why and platform == "gpu" and kv_quant.is_quantized(kv_dtype):
                from pallas_kernels import gpu

                why = gpu.unsupported(dtype, shape.head_dim, shape.group, shape.block_size,
                                      kv_dtype=kv_quant.KV_QUANT_DTYPES[kv_dtype])
            if why and requested:
                raise UserError(f"Attention backend 'pallas' cannot run this model here: {why}; "
                                "use --attention-backend xla.", param="attention_backend")
            if why:
                log.warning("Pallas attention unavailable (%s); using the portable 'xla' backend.", why)
                name, reason = "xla", f"pallas unavailable: {why}"
        layout = "tpu-fused" if (name, platform) == ("pallas", "tpu") else "paged"
        hopper = platform == "gpu" and pallas_kernels.gpu_capable(compute_capability)
        return Backend(platform, name, layout, False, False, reason,
                       fallback="xla" if name == "pallas" and not requested else None, hopper=hopper)
    native_dtypes = dtype == "float32" and (kv_dtype in ("float32", "bfloat16") or kv_quant.is_quantized(kv_dtype))
    if requested in (None, "cpu"):
        why = None if native_dtypes else (
            f"the native kernels compute in float32 with float32, bfloat16, int8 or fp8 KV, "
            f"not {dtype} with {kv_dtype} KV "
            "(bfloat16 weights on them: --dtype float32 --quantization bfloat16)")
        why = why or cpu_kernels.available()  # builds the library now, outside any trace
        if why is None:
            native_linear = tensor_parallel_size == 1
            reason = "native CPU kernels built" + ("" if native_linear else "; XLA dot under tensor parallelism")
            return Backend("cpu", "cpu", "cpu-tiled", native_linear, True, reason, dot_isa=cpu_kernels.choose_isa())
        if requested == "cpu":
            raise UserError(f"Attention backend 'cpu' cannot run here ({why}): install g++ (or set $CXX), "
                            "use --dtype float32, or use --attention-backend xla.", param="attention_backend")
        log.warning("Native CPU kernels unavailable (%s); using the slower 'xla' backend.", why)
        return Backend("cpu", "xla", "paged", False, False, f"native kernels unavailable: {why}")
    # pallas on CPU is the TPU kernel in its interpreter, on its own layout
    if requested == "pallas" and kv_quant.is_quantized(kv_dtype) and shape is not None:
        from pallas_kernels import tpu

        packing = tpu.sublanes(kv_quant.KV_QUANT_DTYPES[kv_dtype])
        if shape.block_size % packing:
            raise UserError(f"KV cache dtype {kv_dtype!r} on 'pallas' (the TPU kernel, interpreted on CPU) needs a "
                            f"block size multiple of {packing} (the TPU's sublane packing of 8-bit data), not "
                            f"{shape.block_size}: use --block-size {packing}, or --attention-backend cpu or xla.",
                            param="block_size")
    layout = "tpu-fused" if requested == "pallas" else "paged"
    return Backend("cpu", requested, layout, False, False, "requested")
