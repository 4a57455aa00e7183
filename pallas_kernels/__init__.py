"""Pallas kernels for jaxserve, each next to its pure-jnp reference.

``ragged_paged_attention`` picks a backend: ``tpu`` (Mosaic TPU), ``gpu`` (Mosaic GPU, bf16/f16,
Hopper sm_90a only), ``reference`` (pure jnp) or ``auto`` (from ``jax.default_backend()``; on CPU the TPU
kernel in its interpreter when ``interpret=True``, else the reference). ``for_step(decode_only=)``
fixes the step kind per compiled bucket: decode-only steps get the split-KV ``gpu_decode`` kernel
on GPU and the decode row of the block-size table on TPU. ``supported(...)`` says, before anything
traces, whether a platform's kernel runs a shape (else why), for backend resolution.
``write_kv`` dispatches the same way: a Mosaic TPU kernel on tpu, XLA's scatter on gpu/reference.
The TPU kernel reads (and ``write_kv`` writes) the ``tpu-fused`` layout, one array per layer
(``tpu.fused_shape``), passed as ``k_pages`` with ``v_pages=None``; given separate K/V pages the
TPU path fuses them first (tests, this generic API). Quantized KV (``kv_quant.QuantPages``) is
read by every kernel: on TPU the fused int8/fp8 data with f32 scales [nb, 2 * Hkv, bs]
(``tpu.fused_scale_shape``).
With ``interpret=True`` the tpu/gpu kernels run in Pallas' interpreters on any host;
``compile_check`` compiles them for a real TPU with libtpu on any host, ``tpu_cases`` lists every
shape served with its VMEM/SMEM budget (``tpu_budget``). ``tpu_gmm.gmm`` is the MoE experts'
grouped matmul for TPU (``jax.lax.ragged_dot``'s contract, megablox class), ``gpu_gmm.gmm`` the same
for Hopper GPUs (Mosaic GPU). Nothing here imports
``jaxserve``.
"""
from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels import kv_quant, reference

Backend = Literal["auto", "tpu", "gpu", "reference"]

__all__ = ["for_step", "gpu_capable", "ragged_paged_attention", "resolve_backend", "supported", "write_kv"]

TPU_DTYPES = ("float32", "bfloat16", "float16")
HEAD_DIMS = (64, 80, 96, 128, 256)
# WGMMA and TMA as the kernels use them: Hopper. Blackwell (sm_100, sm_120) has no wgmma; the
# compile tier (tools/compile_tier.py) decides what else is admitted, one target at a time.
GPU_CAPABILITIES = ((9, 0),)


def _capability(cc) -> tuple[int, int] | None:
    if cc is None or isinstance(cc, tuple):
        return cc
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def gpu_capable(compute_capability) -> bool:
    """Whether a GPU of this compute capability (``"9.0"``, ``(9, 0)``) runs the Mosaic GPU kernels."""
    try:
        return _capability(compute_capability) in GPU_CAPABILITIES
    except ValueError:  # not an NVIDIA ``major.minor``
        return False


def supported(
    platform: str,
    *,
    dtype,
    head_dim: int,
    group: int,
    block_size: int,
    compute_capability: str | tuple[int, int] | None = None,
    kv_dtype=None,
) -> str | None:
    """None when this platform's Pallas kernel runs the shape, else the reason it cannot.

    Meant for backend resolution at engine construction (so a bad choice fails there, or falls
    back to the portable path with one warning), not per call. ``platform``: ``gpu``/``cuda``
    or ``tpu``; ``compute_capability`` (``"9.0"`` or ``(9, 0)``) is the GPU's, from
    ``compat.compute_capability(device)``. ``kv_dtype``: the pages' storage dtype when it is not
    ``dtype`` (int8/fp8 for a quantized cache, ``dtype`` being the compute dtype); the TPU block
    size must be a multiple of its sublane packing (32 rows of an 8-bit dtype).
    """
    import jax.numpy as jnp

    if platform in ("gpu", "cuda"):
        cc = _capability(compute_capability)
        if cc not in GPU_CAPABILITIES:
            have = "unknown" if cc is None else f"sm_{cc[0]}{cc[1]}"
            return (f"the Mosaic GPU attention kernels are built for Hopper sm_90a (WGMMA/TMA); "
                    f"this GPU is {have}")
        from pallas_kernels import gpu

        return gpu.unsupported(dtype, head_dim, group, block_size)
    if platform == "tpu":
        name = jnp.dtype(dtype).name
        if name not in TPU_DTYPES:
            return f"the TPU attention kernel supports {TPU_DTYPES}, not {name}"
        if head_dim not in HEAD_DIMS:
            return f"the TPU attention kernel supports head_dim {HEAD_DIMS}, not {head_dim}"
        from pallas_kernels import tpu

        stored = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
        if group < 1 or block_size % tpu.sublanes(stored):
            return (f"the TPU attention kernel needs a block size multiple of {tpu.sublanes(stored)} "
                    f"(the sublane packing of {stored.name}), not {block_size}")
        return None
    return f"no Pallas attention kernel for platform {platform!r} (use xla)"


def resolve_backend(backend: Backend = "auto", interpret: bool = False) -> str:
    """``auto``: the kernel for this platform; on CPU the TPU kernel when interpreting (it
    handles float32 exactly, the GPU kernel needs bf16), else the jnp reference."""
    if backend == "auto":
        platform = jax.default_backend()
        default = "tpu" if interpret else "reference"
        return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}.get(platform, default)
    if backend not in ("tpu", "gpu", "reference"):
        raise ValueError(f"unknown attention backend {backend!r}: use auto, tpu, gpu or reference")
    return backend


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D] (tpu: or the tpu-fused pages)
    v_pages: jax.Array | None,  # [num_blocks, block_size, Hkv, D] (None with tpu-fused pages)
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1]
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: Backend = "auto",
    interpret: bool = False,
    decode_only: bool = False,
    sinks: jax.Array | None = None,
    **block_sizes: int,
) -> jax.Array:  # [T, Hq, D]
    """Attention of each new token over its own sequence's paged KV (see ``reference``).

    ``decode_only`` (static, per compiled bucket): every sequence has exactly one new token and
    token t is sequence t; on gpu that selects the split-KV decode kernel (``gpu_decode``), on
    tpu the decode row of ``tpu.block_sizes`` (explicit ``block_sizes`` override the table).
    ``block_sizes``: ``block_q``/``pages_per_chunk`` for tpu, ``pages_per_chunk`` for gpu
    (and ``num_splits`` for its decode kernel). ``sinks``: f32[Hq] per-head sink logits
    (gpt-oss) or None, which adds nothing to any kernel.
    """
    args = (q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, num_seqs)
    kwargs = {"sm_scale": sm_scale, "sliding_window": sliding_window, "soft_cap": soft_cap, "sinks": sinks}
    name = resolve_backend(backend, interpret)
    if name == "tpu":
        from pallas_kernels import tpu

        fused = v_pages is None  # the tpu-fused layout [nb, 2 * Hkv, bs, Dp]
        hkv = k_pages.shape[1] // 2 if fused else k_pages.shape[2]
        bs = k_pages.shape[2] if fused else k_pages.shape[1]
        table = tpu.block_sizes(decode_only, q.shape[1] // hkv, bs, num_kv_heads=hkv,
                                head_dim=q.shape[2], itemsize=k_pages.dtype.itemsize)
        sizes = {**table, **block_sizes}
        return tpu.ragged_paged_attention(*args, **kwargs, **sizes, interpret=interpret)
    if name == "gpu" and decode_only:
        from pallas_kernels import gpu_decode

        return gpu_decode.decode_attention(*args, **kwargs, **block_sizes, interpret=interpret)
    if name == "gpu":
        from pallas_kernels import gpu

        return gpu.ragged_paged_attention(*args, **kwargs, **block_sizes, interpret=interpret)
    return reference.ragged_paged_attention(*args, **kwargs)


def for_step(*, decode_only: bool, backend: Backend = "auto", interpret: bool = False):
    """The attention function for one compiled step: the runner builds one per bucket, so the
    choice of kernel (split-KV decode or the general one) is made once, from the bucket's shape."""
    import functools

    return functools.partial(ragged_paged_attention, backend=backend, interpret=interpret,
                             decode_only=decode_only)


def write_kv(
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D], or the tpu-fused pages
    v_pages: jax.Array | None,  # [num_blocks, block_size, Hkv, D], None with tpu-fused pages
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]
    *,
    backend: Backend = "auto",
    interpret: bool = False,
    tokens_per_step: int = 8,
) -> tuple[jax.Array, jax.Array | None]:
    """New K/V into their slots (in place when the pages are donated).

    Fused pages (``v_pages`` None, ``tpu.fused_shape``): ``kv_write.write_kv_fused``, whole pages
    read into VMEM, the new rows selected in, written back once per page, whatever the backend.

    ``tpu`` (and ``auto`` on CPU with ``interpret=True``): the Mosaic TPU kernel in ``kv_write``,
    pages aliased in HBM and one DMA per new row, ``tokens_per_step`` rows per grid step.
    ``gpu``/``reference``: one XLA scatter; on GPU that is already a single fused kernel that
    moves only the new rows, so there is no Pallas kernel for it.
    """
    name = resolve_backend(backend, interpret)
    if v_pages is None:  # the tpu-fused layout: one array, returned as (pages, None)
        from pallas_kernels import kv_write

        pages = kv_write.write_kv_fused(k_pages, k, v, slot_mapping,
                                        tokens_per_step=tokens_per_step, interpret=interpret)
        return pages, None
    if name == "tpu" and isinstance(k_pages, kv_quant.QuantPages):
        # Quantized here, then the same DMA kernel moves the bytes and (as rows of one value) the scales.
        from pallas_kernels import kv_write

        (kq, ks), (vq, vs) = (kv_quant.quantize(x, k_pages.dtype) for x in (k, v))
        kw = dict(tokens_per_step=tokens_per_step, interpret=interpret)
        kd, vd = kv_write.write_kv_tpu(k_pages.data, v_pages.data, kq, vq, slot_mapping, **kw)
        kss, vss = kv_write.write_kv_tpu(k_pages.scale[..., None], v_pages.scale[..., None], ks[..., None],
                                         vs[..., None], slot_mapping, **kw)
        return kv_quant.QuantPages(kd, kss[..., 0]), kv_quant.QuantPages(vd, vss[..., 0])
    if name == "tpu":
        from pallas_kernels import kv_write

        return kv_write.write_kv_tpu(
            k_pages, v_pages, k, v, slot_mapping, tokens_per_step=tokens_per_step,
            interpret=interpret,
        )
    return reference.write_kv(k_pages, v_pages, k, v, slot_mapping)
