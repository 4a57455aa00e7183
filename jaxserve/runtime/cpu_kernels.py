"""Native CPU kernels as XLA FFI custom calls: the `cpu` attention backend (KV write and ragged
paged attention), the float32 matmul of the model's linear layers (and the MLP's gated pair of
them), the quantized and dot-product (bfloat16, W8A8) matmuls of runtime/quant.py, and greedy
sampling's argmax.

The library is built on first use (runtime/native_build.py) and registered here. Where no
compiler works, `available()` says why and the backend (backend.py) chooses XLA's own ops (the
`xla` attention backend, XLA's dot) instead; the functions here are the calls themselves and check
nothing at trace time.

Which instructions a kernel uses is decided at run time too, not only by the build: `choose_isa`
takes the CPU's flags (runtime/cpu_isa.py), what the library was compiled with and what Linux grants
(AMX's tile state): AMX tiles where present, else AVX512_BF16 / AVX512_VNNI, else the portable path
of the same kernel (`$JAXSERVE_CPU_ISA=avx512` or `portable` caps it). The backend makes that
choice once (runtime/backend.py's `Backend.dot_isa`) and it flows to the calls (runtime/quant.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.compat import ffi
from jaxserve.runtime.cpu_isa import AMX_BIT, AMX_PATHS, DOT_PATHS, ISA_ENV, cpu_features, isa_cap
from jaxserve.runtime.native_build import build, format_table
from jaxserve.runtime.rope_fusion import Rope, native_operands
from pallas_kernels.kv_quant import QuantPages

TARGETS = {"jaxserve_paged_attention": "JaxservePagedAttention", "jaxserve_write_kv": "JaxserveWriteKv",
           "jaxserve_paged_attention_quant": "JaxservePagedAttentionQuant",
           "jaxserve_write_kv_quant": "JaxserveWriteKvQuant",
           "jaxserve_matmul": "JaxserveMatmul", "jaxserve_matmul_gated": "JaxserveMatmulGated",
           "jaxserve_argmax": "JaxserveArgmax",
           "jaxserve_quant_matmul": "JaxserveQuantMatmul",
           "jaxserve_quant_matmul_gated": "JaxserveQuantMatmulGated",
           "jaxserve_dot_matmul": "JaxserveDotMatmul", "jaxserve_dot_matmul_gated": "JaxserveDotMatmulGated",
           "jaxserve_quant_matmul_grouped": "JaxserveQuantMatmulGrouped",
           "jaxserve_dot_matmul_grouped": "JaxserveDotMatmulGrouped",
           "jaxserve_moe_route": "JaxserveMoeRoute", "jaxserve_moe_gather": "JaxserveMoeGather",
           "jaxserve_moe_combine": "JaxserveMoeCombine"}

_lock = threading.Lock()
_state: dict = {}  # "error": str | None once a build was tried


def amx_permitted() -> str | None:
    """None when this process may use AMX tiles (asked of Linux once: arch_prctl
    ARCH_REQ_XCOMP_PERM), else why not. The native library must be available()."""
    with _lock:
        if "amx" not in _state:
            if not cpu_features() & set(AMX_PATHS.values()):
                _state["amx"] = "the CPU has no AMX"
            elif not _state["lib"].JaxserveDotIsa() & AMX_BIT:
                _state["amx"] = "the library was built without AMX (compiler or -march)"
            else:
                err = _state["lib"].JaxserveAmxPermit()
                _state["amx"] = None if err == 0 else f"Linux refused the AMX tile state ({os.strerror(err)})"
        return _state["amx"]


@dataclass(frozen=True)
class DotIsa:
    """csrc/dot_matmul.cc's `isa` attribute per weight format, chosen once (`choose_isa`, by the
    backend) and passed to the calls: 2 AMX tiles (amx_bf16 / amx_int8, where Linux grants them),
    1 the AVX-512 dot-product instruction (vdpbf16ps / vpdpbusd), 0 the portable code (isa 1's sums
    in isa 1's order)."""

    cap: str  # what it was chosen under: auto | avx512 | portable (runtime/cpu_isa.py)
    by_format: tuple[tuple[str, int], ...]  # (weight format name, isa)

    def __getitem__(self, format_name: str) -> int:
        return dict(self.by_format)[format_name]


def choose_isa(cap: str | None = None) -> DotIsa:
    """The instructions each dot-product format runs here, from what the CPU has and the library
    was built with, capped by `cap`: `avx512` (no AMX) or `portable`; None: the user's
    `$JAXSERVE_CPU_ISA` (unset: auto), read here only (the backend asks once, runtime/backend.py).
    The native library must be available()."""
    return _choose_isa(isa_cap(cap))


@functools.cache
def _choose_isa(cap: str) -> DotIsa:
    def isa(format_name: str) -> int:
        flag, bit = DOT_PATHS[format_name]
        if cap == "portable" or not (flag in cpu_features() and _state["lib"].JaxserveDotIsa() & bit):
            return 0
        if cap == "auto" and AMX_PATHS[format_name] in cpu_features() and amx_permitted() is None:
            return 2
        return 1

    return DotIsa(cap, tuple((name, isa(name)) for name in DOT_PATHS))


def attention_isa(isa: DotIsa) -> int:
    """csrc/paged_attention.cc's `isa` attribute under the dot-product choice `isa`: 1 (bfloat16
    pages' dot products) wherever the bfloat16 matmul has AVX-512 BF16 (isa 1, or AMX's machines,
    which have it too), else 0. The backend passes it only to a model that computes in bfloat16
    (Backend.bf16_compute): float32 compute keeps float32 attention products."""
    return 1 if isa["bfloat16"] >= 1 else 0


def kernel_paths(isa: DotIsa | None = None) -> dict[str, str]:
    """What each native matmul runs here under `isa` (None: `choose_isa()`), for logs and
    benchmarks: {"float32": ..., "bfloat16": ..., "w8a8": ..., "amx": ...}."""
    if available() is not None:
        return {}
    isa = choose_isa() if isa is None else isa
    paths = {"float32": "packed FMA panels (-march=native)"}
    for name, (flag, _) in DOT_PATHS.items():
        paths[name] = {2: AMX_PATHS[name], 1: flag, 0: "portable"}[isa[name]]
    amx = " ".join(sorted(f for f in cpu_features() if f.startswith("amx")))
    used = [name for name, i in isa.by_format if i == 2]
    if not amx:
        paths["amx"] = "absent"
    elif used:
        paths["amx"] = f"{amx}: used by {', '.join(used)}"
    else:
        paths["amx"] = f"{amx} present, not used ({amx_permitted() or f'${ISA_ENV}={isa.cap}'})"
    return paths


def available() -> str | None:
    """Build and register the kernel once; None when ready, else the reason it cannot be used."""
    with _lock:
        if "error" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(str(build()))
                check_formats(lib)
                for target, symbol in TARGETS.items():
                    ffi.register_ffi_target(target, ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["lib"], _state["error"] = lib, None
            except Exception as e:  # noqa: BLE001  (any failure means: use the xla backend)
                _state["error"] = f"{type(e).__name__}: {e}"
        return _state["error"]


def library_name() -> str | None:
    """The loaded kernel library's path (its name hashes its sources, flags and CPU), None if none."""
    lib = _state.get("lib")
    return getattr(lib, "_name", None)


def check_formats(lib) -> None:
    """RuntimeError unless the library's weight-format table (formats.h, generated at its build) is
    runtime/weight_formats.py's: the ids quant.py passes mean the same formats to the kernels."""
    lib.JaxserveFormats.restype = ctypes.c_char_p
    built, want = lib.JaxserveFormats().decode(), format_table()
    if built != want:
        raise RuntimeError(f"the kernel library's weight formats ({built}) are not "
                           f"runtime/weight_formats.py's ({want})")


def to_cpu_layout(k_pages, v_pages):
    """Pages in the engine's [nb, bs, Hkv, D] layout -> this backend's (same shape; K blocks hold
    [Hkv, D, bs], V blocks [Hkv, bs, D], quantized pages' scale blocks [Hkv, bs]: see
    csrc/paged_attention.cc). For tests and tools."""
    if isinstance(k_pages, QuantPages):
        k, v = to_cpu_layout(k_pages.data, v_pages.data)
        nb, bs, hkv = k_pages.scale.shape
        scales = [jnp.transpose(s, (0, 2, 1)).reshape(nb, bs, hkv) for s in (k_pages.scale, v_pages.scale)]
        return QuantPages(k, scales[0]), QuantPages(v, scales[1])
    nb, bs, hkv, d = k_pages.shape
    k = jnp.transpose(k_pages, (0, 2, 3, 1)).reshape(nb, bs, hkv, d)
    v = jnp.transpose(v_pages, (0, 2, 1, 3)).reshape(nb, bs, hkv, d)
    return k, v


def cpu_ragged_paged_attention(
    q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, num_seqs,
    *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None, sinks=None,
    rope: Rope | None = None, isa: int = 0, **unused,
):
    """`xla_ragged_paged_attention` over pages written by `cpu_write_kv` (the `cpu-tiled` KV
    layout): float32 q, float32 or bfloat16 pages, or QuantPages (int8/fp8 and their scales). The
    backend checks dtypes once (backend.resolve_backend); this is the call itself. ``sinks``:
    f32[Hq] per-head sink logits (gpt-oss), or None (an empty operand: no sink term). ``rope``: q
    is rotated by it as the kernel loads it (runtime/rope_fusion.py), or None: q as given. ``isa``
    (`attention_isa`): 1 bfloat16 pages' scores and sums as AVX-512 BF16 dot products, q and the
    probabilities rounded to bfloat16 (csrc/attention_vec.h); 0 float32 FMAs."""
    if sinks is None:
        sinks = jnp.zeros((0,), jnp.float32)
    elif sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be f32[{q.shape[1]}] (one logit per query head), got shape {sinks.shape}")
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    target, pages = "jaxserve_paged_attention", (k_pages, v_pages)
    if isinstance(k_pages, QuantPages):
        target, pages = "jaxserve_paged_attention_quant", (k_pages.data, v_pages.data, k_pages.scale, v_pages.scale)
    return ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(
        q, *pages, i32(seq_lens), i32(query_start_loc), i32(block_tables), i32(num_seqs),
        sinks.astype(jnp.float32), *native_operands(rope), sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0), isa=np.int64(isa),
    )


def cpu_write_kv(k_pages, v_pages, k, v, slot_mapping, rope: Rope | None = None):
    """`write_kv` (rounding to the pages' dtype, or quantizing as kv_quant.quantize does, in the
    native call: no extra XLA ops per layer) into the `cpu-tiled` layout, in place through aliased
    outputs. ``rope``: the K rows are rotated by it first, in the call (runtime/rope_fusion.py)."""
    tables = native_operands(rope)
    if isinstance(k_pages, QuantPages):
        data = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
        scale = jax.ShapeDtypeStruct(k_pages.scale.shape, jnp.float32)
        kd, vd, kss, vss = ffi.ffi_call(
            "jaxserve_write_kv_quant", (data, data, scale, scale), input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
            vmap_method="sequential")(k_pages.data, v_pages.data, k_pages.scale, v_pages.scale, k.astype(jnp.float32),
                                      v.astype(jnp.float32), slot_mapping.astype(jnp.int32), *tables)
        return QuantPages(kd, kss), QuantPages(vd, vss)
    pages = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    return ffi.ffi_call("jaxserve_write_kv", (pages, pages), input_output_aliases={0: 0, 1: 1},
                            vmap_method="sequential")(k_pages, v_pages, k.astype(jnp.float32),
                                                      v.astype(jnp.float32), slot_mapping.astype(jnp.int32),
                                                      *tables)


PANEL = 64  # columns per packed weight panel (csrc/matmul.cc)


def packable(kernel_shape) -> bool:
    """Whether a linear layer's [K, N] kernel is packed for `cpu_matmul`."""
    return len(kernel_shape) == 2 and kernel_shape[1] % PANEL == 0


def pack_kernel(w):
    """[K, N] -> [N / 64, K, 64]: 64-column panels, each contiguous (what `cpu_matmul` reads)."""
    k, n = w.shape
    return jnp.transpose(w.reshape(k, n // PANEL, PANEL), (1, 0, 2))


def unpack_kernel(wp):
    """Inverse of `pack_kernel`."""
    panels, k, _ = wp.shape
    return jnp.transpose(wp, (1, 0, 2)).reshape(k, panels * PANEL)


def _rows(x, num_rows):
    return jnp.reshape(jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32), (1,))


def cpu_matmul(x, wp, num_rows=None):
    """`x @ W` for float32 x[M, K] and W packed by `pack_kernel`. Each output row is summed in k
    order with FMAs whatever the batch is, so a row's result does not depend on the other rows.
    With `num_rows` (an int or i32[1]: the step's real tokens) only the first num_rows rows are
    computed and the rest come out zero."""
    out = jax.ShapeDtypeStruct((x.shape[0], wp.shape[0] * PANEL), jnp.float32)
    return ffi.ffi_call("jaxserve_matmul", out, vmap_method="sequential")(x, wp, _rows(x, num_rows))


def cpu_matmul_gated(x, wp_gate, wp_up, num_rows=None):
    """`silu(x @ W_gate) * (x @ W_up)` (the gated MLP's first half) in one native call: SiLU and the
    product are applied to each tile as it is computed. Rows as in `cpu_matmul`."""
    out = jax.ShapeDtypeStruct((x.shape[0], wp_gate.shape[0] * PANEL), jnp.float32)
    return ffi.ffi_call("jaxserve_matmul_gated", out, vmap_method="sequential")(
        x, wp_gate, wp_up, _rows(x, num_rows))


def argmax_rows(x):
    """Index of each row's largest value (the first among ties) of float32 x[S, V] as int32[S]."""
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    return ffi.ffi_call("jaxserve_argmax", out, vmap_method="sequential")(x.astype(jnp.float32))
