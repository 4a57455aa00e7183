"""Native CPU kernels as XLA FFI custom calls: the `cpu` attention backend (KV write and ragged
paged attention), the float32 matmul of the model's linear layers (and the MLP's gated pair of
them), the quantized and dot-product (bfloat16, W8A8) matmuls of runtime/quant.py, and greedy
sampling's argmax.

The C++ sources (`csrc/*.cc`) are compiled on first use with the system C++ compiler (`$CXX`,
else `g++`/`c++`) against the XLA FFI headers that ship with jaxlib, for this machine's CPU
(-march=native), into one library cached under `$JAXSERVE_CACHE_DIR/kernels`, keyed by the
sources, the flags, jaxlib's version and the CPU. Where no compiler works, `available()` says why
and the backend (backend.py) chooses XLA's own ops (the `xla` attention backend, XLA's dot)
instead; the functions here are the calls themselves and check nothing at trace time.

Which instructions a kernel uses is decided at run time too, not only by the build: `dot_isa`
takes the CPU's flags (`cpu_features`), what the library was compiled with and what Linux grants
(AMX's tile state), and passes the choice to the call: AMX tiles where present, else
AVX512_BF16 / AVX512_VNNI, else the portable path of the same kernel (`$JAXSERVE_CPU_ISA=avx512`
or `portable` caps it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.default_model import cache_dir
from jaxserve.runtime.compat import ffi
from pallas_kernels.kv_quant import QuantPages

logger = logging.getLogger("jaxserve")
CSRC = Path(__file__).with_name("csrc")
TARGETS = {"jaxserve_paged_attention": "JaxservePagedAttention", "jaxserve_write_kv": "JaxserveWriteKv",
           "jaxserve_paged_attention_quant": "JaxservePagedAttentionQuant",
           "jaxserve_write_kv_quant": "JaxserveWriteKvQuant",
           "jaxserve_matmul": "JaxserveMatmul", "jaxserve_matmul_gated": "JaxserveMatmulGated",
           "jaxserve_argmax": "JaxserveArgmax",
           "jaxserve_quant_matmul": "JaxserveQuantMatmul",
           "jaxserve_quant_matmul_gated": "JaxserveQuantMatmulGated",
           "jaxserve_dot_matmul": "JaxserveDotMatmul", "jaxserve_dot_matmul_gated": "JaxserveDotMatmulGated"}
# $JAXSERVE_CXXFLAGS is appended (e.g. "-fsanitize=address -g" to check the kernels' memory accesses).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", *os.environ.get("JAXSERVE_CXXFLAGS", "").split()]
# Linking with -ffast-math (GCC < 13) adds crtfastmath.o, whose constructor switches the thread that
# loads the library (Python's main thread, where numpy and XLA's inline thunks run) to flush-to-zero
# and denormals-are-zero for the rest of the process. -ffast-math is for compiling the kernels only.
LINK_FLAGS = [f for f in FLAGS if f not in ("-ffast-math", "-Ofast")]

_lock = threading.Lock()
_state: dict = {}  # "error": str | None once a build was tried


def _cpuinfo_flags_line() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return None


def _cpu_fingerprint() -> str:
    return _cpuinfo_flags_line() or platform.processor() or platform.machine()


@functools.cache  # read once: dot_isa asks at every traced linear layer
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (/proc/cpuinfo: "avx512_bf16", "avx512_vnni",
    "amx_bf16", ...); empty where that file is not there (then only portable kernels run)."""
    line = _cpuinfo_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if line and ":" in line else frozenset()


# The dot-product kernels (csrc/dot_matmul.cc) per weight format: the CPU flag their fast path
# needs, and the bit of JaxserveDotIsa() saying the library was built with it; and the AMX tiles'.
DOT_PATHS = {"bfloat16": ("avx512_bf16", 1), "w8a8": ("avx512_vnni", 2), "w4a8": ("avx512_vnni", 2),
             "q8a8": ("avx512_vnni", 2)}
AMX_PATHS = {"bfloat16": "amx_bf16", "w8a8": "amx_int8", "w4a8": "amx_int8", "q8a8": "amx_int8"}
AMX_BIT = 4
ISA_ENV = "JAXSERVE_CPU_ISA"  # "portable" / "avx512": cap the instructions below what the CPU has
ISA_CHOICES = ("auto", "avx512", "portable")


def _isa_cap() -> str:
    cap = os.environ.get(ISA_ENV, "auto")
    if cap not in ISA_CHOICES:
        raise ValueError(f"${ISA_ENV}={cap!r}: expected one of {', '.join(ISA_CHOICES)} (unset means auto)")
    return cap


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


def dot_isa(fmt: str) -> int:
    """The `isa` attribute of csrc/dot_matmul.cc for weight format `fmt` ("bfloat16", "w8a8", "w4a8", "q8a8"),
    chosen here, at trace time, from what the CPU has and the library was built with: 2 AMX tiles
    (amx_bf16 / amx_int8, where Linux grants them), 1 the AVX-512 dot-product instruction
    (vdpbf16ps / vpdpbusd), 0 the portable code (isa 1's sums in isa 1's order).
    `$JAXSERVE_CPU_ISA` caps the choice: `avx512` (no AMX) or `portable`. The native library must
    be available()."""
    flag, bit = DOT_PATHS[fmt]
    cap = _isa_cap()
    if cap == "portable" or not (flag in cpu_features() and _state["lib"].JaxserveDotIsa() & bit):
        return 0
    if cap == "auto" and AMX_PATHS[fmt] in cpu_features() and amx_permitted() is None:
        return 2
    return 1


def kernel_paths() -> dict[str, str]:
    """What each native matmul runs here, for logs and benchmarks: {"float32": ..., "bfloat16":
    ..., "w8a8": ..., "amx": ...}."""
    if available() is not None:
        return {}
    paths = {"float32": "packed FMA panels (-march=native)"}
    isas = {fmt: dot_isa(fmt) for fmt in DOT_PATHS}
    for fmt, (flag, _) in DOT_PATHS.items():
        paths[fmt] = {2: AMX_PATHS[fmt], 1: flag, 0: "portable"}[isas[fmt]]
    amx = " ".join(sorted(f for f in cpu_features() if f.startswith("amx")))
    used = [fmt for fmt, isa in isas.items() if isa == 2]
    if not amx:
        paths["amx"] = "absent"
    elif used:
        paths["amx"] = f"{amx}: used by {', '.join(used)}"
    else:
        paths["amx"] = f"{amx} present, not used ({amx_permitted() or f'${ISA_ENV}={_isa_cap()}'})"
    return paths


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set $CXX)")
    sources = sorted(CSRC.glob("*.cc"))
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in sources + sorted(CSRC.glob("*.h"))), " ".join([cxx, *FLAGS, "|", *LINK_FLAGS]).encode(), jax.__version__.encode(),
                 _cpu_fingerprint().encode()):
        key.update(part)
    out = cache_dir() / "kernels" / f"jaxserve_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        if _verified(out):
            return out
        logger.warning("The cached CPU kernel library %s is damaged (truncated or changed): rebuilding it", out)
        out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # One compiler process per source, side by side (the attention source alone takes ~10 s).
        objs = [Path(tmp) / f"{src.stem}.o" for src in sources]
        logs = [Path(tmp) / f"{src.stem}.log" for src in sources]
        procs = []
        for src, obj, log in zip(sources, objs, logs):
            with open(log, "w") as err:  # a file, not a pipe: a chatty compiler cannot block on it
                procs.append(subprocess.Popen([cxx, *FLAGS, "-c", f"-I{ffi.include_dir()}", str(src), "-o", str(obj)],
                                              stdout=subprocess.DEVNULL, stderr=err))
        results = [(proc.wait(), log.read_text()) for proc, log in zip(procs, logs)]
        tmp_so = Path(tmp) / out.name
        if all(rc == 0 for rc, _ in results):
            link = subprocess.run([cxx, *LINK_FLAGS, *map(str, objs), "-o", str(tmp_so)], capture_output=True, text=True,
                                  check=False)
            results.append((link.returncode, link.stderr))
        for rc, err in results:
            if rc != 0:
                raise RuntimeError(f"{cxx} failed: {err.strip()[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see half a file
    _write_digest(out)
    return out


def _digest_path(so: Path) -> Path:
    return so.with_suffix(".so.sha256")


def _write_digest(so: Path) -> None:
    """The library's size and sha256 beside it (written atomically after it), checked before
    every load: loading a truncated library kills the process with SIGBUS."""
    data = so.read_bytes()
    tmp = so.with_suffix(f".so.sha256.{os.getpid()}.tmp")
    tmp.write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    os.replace(tmp, _digest_path(so))


def _verified(so: Path) -> bool:
    """Whether `so` is whole: its digest matches, or (a library cached before digests were
    written) a child process loads it without dying, and then the digest is written."""
    try:
        data = so.read_bytes()
        want = _digest_path(so).read_text().split()
    except FileNotFoundError:
        want = None
    except OSError:
        return False
    if want is not None:
        return want == [str(len(data)), hashlib.sha256(data).hexdigest()]
    probe = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(so)],
                           capture_output=True, check=False, timeout=120)
    if probe.returncode != 0:
        return False
    _write_digest(so)
    return True


def available() -> str | None:
    """Build and register the kernel once; None when ready, else the reason it cannot be used."""
    with _lock:
        if "error" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                for target, symbol in TARGETS.items():
                    ffi.register_ffi_target(target, ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["lib"], _state["error"] = lib, None
            except Exception as e:  # noqa: BLE001  (any failure means: use the xla backend)
                _state["error"] = f"{type(e).__name__}: {e}"
        return _state["error"]


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
    *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None, sinks=None, **unused,
):
    """`xla_ragged_paged_attention` over pages written by `cpu_write_kv` (the `cpu-tiled` KV
    layout): float32 q, float32 or bfloat16 pages, or QuantPages (int8/fp8 and their scales). The
    backend checks dtypes once (backend.resolve_backend); this is the call itself. ``sinks``:
    f32[Hq] per-head sink logits (gpt-oss), or None (an empty operand: no sink term)."""
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
        sinks.astype(jnp.float32), sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


def cpu_write_kv(k_pages, v_pages, k, v, slot_mapping):
    """`write_kv` (rounding to the pages' dtype, or quantizing as kv_quant.quantize does, in the
    native call: no extra XLA ops per layer) into the `cpu-tiled` layout, in place through aliased
    outputs."""
    if isinstance(k_pages, QuantPages):
        data = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
        scale = jax.ShapeDtypeStruct(k_pages.scale.shape, jnp.float32)
        kd, vd, kss, vss = ffi.ffi_call(
            "jaxserve_write_kv_quant", (data, data, scale, scale), input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
            vmap_method="sequential")(k_pages.data, v_pages.data, k_pages.scale, v_pages.scale, k.astype(jnp.float32),
                                      v.astype(jnp.float32), slot_mapping.astype(jnp.int32))
        return QuantPages(kd, kss), QuantPages(vd, vss)
    pages = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    return ffi.ffi_call("jaxserve_write_kv", (pages, pages), input_output_aliases={0: 0, 1: 1},
                            vmap_method="sequential")(k_pages, v_pages, k.astype(jnp.float32),
                                                      v.astype(jnp.float32), slot_mapping.astype(jnp.int32))


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
