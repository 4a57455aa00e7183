"""The `cpu` attention backend: native KV write and ragged paged attention as XLA FFI custom calls.

The C++ source (`csrc/paged_attention.cc`) is compiled on first use with the system C++ compiler
(`$CXX`, else `g++`/`c++`) against the XLA FFI headers that ship with jaxlib, for this machine's
CPU (-march=native), and cached under `$JAXSERVE_CACHE_DIR/kernels` keyed by the source, the
flags, jaxlib's version and the CPU. Where no compiler works, `available()` says why and the
engine uses the `xla` backend instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.default_model import cache_dir
from jaxserve.runtime.attention import write_kv, xla_ragged_paged_attention

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cc"
TARGETS = {"jaxserve_paged_attention": "JaxservePagedAttention", "jaxserve_write_kv": "JaxserveWriteKv"}
FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC"]

_lock = threading.Lock()
_state: dict = {}  # "error": str | None once a build was tried


def _cpu_fingerprint() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set $CXX)")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join([cxx, *FLAGS]).encode(), jax.__version__.encode(),
                 _cpu_fingerprint().encode()):
        key.update(part)
    out = cache_dir() / "kernels" / f"paged_attention-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp_so)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see half a file
    return out


def available() -> str | None:
    """Build and register the kernel once; None when ready, else the reason it cannot be used."""
    with _lock:
        if "error" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["lib"], _state["error"] = lib, None
            except Exception as e:  # noqa: BLE001  (any failure means: use the xla backend)
                _state["error"] = f"{type(e).__name__}: {e}"
        return _state["error"]


def native(compute_dtype, k_pages_dtype, v_pages_dtype) -> bool:
    """Whether the native kernels run these dtypes: float32 q/k/v, float32 or bfloat16 pages."""
    return (compute_dtype == jnp.float32 and k_pages_dtype == v_pages_dtype
            and k_pages_dtype in (jnp.float32, jnp.bfloat16) and available() is None)


def to_cpu_layout(k_pages, v_pages):
    """Pages in the engine's [nb, bs, Hkv, D] layout -> this backend's (same shape; K blocks hold
    [Hkv, D, bs], V blocks [Hkv, bs, D]: see csrc/paged_attention.cc). For tests and tools."""
    nb, bs, hkv, d = k_pages.shape
    k = jnp.transpose(k_pages, (0, 2, 3, 1)).reshape(nb, bs, hkv, d)
    v = jnp.transpose(v_pages, (0, 2, 1, 3)).reshape(nb, bs, hkv, d)
    return k, v


def cpu_ragged_paged_attention(
    q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, num_seqs,
    *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None, **unused,
):
    """`xla_ragged_paged_attention` over pages written by `cpu_write_kv`. Runs natively for float32
    q with float32 or bfloat16 pages (otherwise, or without a compiler, both functions fall back
    to XLA and the engine's layout)."""
    if not native(q.dtype, k_pages.dtype, v_pages.dtype):
        return xla_ragged_paged_attention(
            q, k_pages, v_pages, seq_lens, query_start_loc, block_tables, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        )
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    return jax.ffi.ffi_call("jaxserve_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(
        q, k_pages, v_pages, i32(seq_lens), i32(query_start_loc), i32(block_tables), i32(num_seqs),
        sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


def cpu_write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Same as `write_kv` (the XLA scatter, rounding to the pages' dtype), in place through
    aliased outputs."""
    if not native(k.dtype, k_pages.dtype, v_pages.dtype) or v.dtype != k.dtype:
        return write_kv(k_pages, v_pages, k, v, slot_mapping)
    pages = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    return jax.ffi.ffi_call("jaxserve_write_kv", (pages, pages), input_output_aliases={0: 0, 1: 1},
                            vmap_method="sequential")(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))
