"""Serialized step executables on disk, so a warm start skips tracing and lowering.

XLA's persistent compilation cache (worker/xla_cache.py) saves the compile, but its key
is a hash of the lowered module: every start still traces the 30-layer model and lowers it for
every bucket (~1 s per bucket on the 2-core CPU machine, most of a warm start). This cache keys an
executable by what its trace depends on instead, and loads it with
`jax.experimental.serialize_executable`:

    sha256(jax / jaxlib / flax versions, JAX_* / XLA_* / JAXSERVE_* settings, the jaxserve,
           pallas_kernels and csrc sources, the runner's description (model config, runner config,
           backend, the native library, mesh, the shapes / dtypes / shardings of params and KV cache),
           the bucket)

One file per key under `<XLA cache dir>/jaxserve-steps/` (pickled: trusted like XLA's own cache).
A file that fails to load is ignored (and recompiled and rewritten); writes are atomic. The key
cannot see code patched at run time (a test's monkeypatch).

**Off by default; `JAXSERVE_STEP_CACHE=1` turns it on.** Only an executable XLA compiled in this
process is stored (`compile`): one that XLA's persistent cache served was deserialized, and
serializing it again (jax 0.10.2, XLA:CPU) leaves out its compiled functions, so the stored file
loads and then fails on its first call ("Function bitcast_dynamic-slice_fusion.2 not found": a
warm `serve` died on its first steps that way, 2026-12-03; tests/test_startup.py recreates it).
Such a bucket is not stored, and its warm starts load it from XLA's cache after tracing, as with
this cache off. Without this cache a warm `serve` is healthy as fast (the background warm-up
traces the other buckets).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import weakref

import flax
import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxserve.runtime import cpu_kernels
from jaxserve.worker import xla_cache

log = logging.getLogger("jaxserve")

SUBDIR = "jaxserve-steps"
# settings that name files or trace output, not what a step computes
_IGNORED_ENV = {"JAXSERVE_CACHE_DIR", "JAXSERVE_COMPILATION_CACHE", "JAXSERVE_STARTUP_TRACE", "JAXSERVE_STEP_CACHE"}
_ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """sha256 over the engine's and the kernels' sources (read once per process, ~10 ms)."""
    h = hashlib.sha256()
    for top in ("jaxserve", "pallas_kernels"):
        for p in sorted((_ROOT / top).rglob("*")):
            if p.suffix in (".py", ".cc", ".h") and p.is_file():
                h.update(str(p.relative_to(_ROOT)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def environment() -> str:

    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("JAX", "XLA", "TF_", "JAXSERVE_")) and k not in _IGNORED_ENV
                 and not k.startswith("TF_CPP_"))  # log levels
    return repr((jax.__version__, jaxlib.__version__, flax.__version__, env, sources_digest()))


def directory() -> pathlib.Path | None:
    """Where step executables are kept: beside XLA's cache, None when that cache (or this one) is off."""
    xla = jax.config.jax_compilation_cache_dir
    return pathlib.Path(xla) / SUBDIR if xla and os.environ.get("JAXSERVE_STEP_CACHE", "0") == "1" else None


def describe(runner, key) -> str:
    """Everything bucket `key`'s trace on `runner` (a ModelRunner) depends on besides the sources
    and versions: configs, backend, native library, shapes / dtypes / shardings, mesh, batch layout."""

    def leaves(tree):
        return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))), tree)

    r = runner
    return repr((r.source_config, r.model_cfg, r.cfg, r.backend, r.kv_cache_dtype, str(r.dtype), r.kv_repeat, r.s_max,
                 r.builder.field_specs(key), cpu_kernels.library_name(), leaves(r.params), leaves(r.kv_spec()),
                 r.backend.kv_layout, leaves(r.last_tokens), leaves(r.inv_freq), [str(d) for d in r.mesh.devices.flat],
                 r.mesh.axis_names))


def key_of(description: str, bucket) -> str:
    return hashlib.sha256(f"{environment()}|{description}|{tuple(bucket)!r}".encode()).hexdigest()


def key_for(runner, bucket) -> str | None:
    """The cache key of `bucket` on `runner`, or None when the cache is off (nothing described)."""
    return key_of(describe(runner, bucket), bucket) if directory() is not None else None


# Executables loaded or stored in this process, by key, while something holds them: a second engine
# in the process (or a sampler shared by another engine's buckets) gets the same executable rather
# than a second deserialized twin of its compiled functions beside it.
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def load(key: str | None):
    """The executable stored under `key`, or None."""
    d = directory()
    path = d / f"{key}.bin" if d and key else None
    if path is None:
        return None
    live = _LIVE.get(key)
    if live is not None:
        return live
    if not path.is_file():
        return None
    try:

        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        exe = _LIVE[key] = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        return exe
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: compile instead
        log.warning("Ignoring the cached step executable %s (%s: %s): compiling it", path, type(e).__name__, e)
        return None


def compile(key: str | None, lowered):
    """lowered.compile(), kept under `key` (None: the cache is off) unless XLA's persistent cache
    served it: a deserialized executable is not serialized again (the module docstring)."""
    before = xla_cache.thread_hits()
    compiled = lowered.compile()
    if xla_cache.thread_hits() == before:
        _store(key, compiled)
    elif key is not None:
        log.info("Step executable not cached: XLA's persistent cache served it, and serializing a "
                 "deserialized executable again would leave out its compiled functions")
    return compiled


def _store(key: str | None, compiled) -> None:
    d = directory()
    if d is None or key is None:
        return
    _LIVE[key] = compiled
    try:

        blob = pickle.dumps(serialize_executable.serialize(compiled))
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key}.")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, d / f"{key}.bin")  # atomic: a concurrent reader sees a whole file or none
    except Exception as e:  # noqa: BLE001 - not serializable here (e.g. a backend without it): no cache
        log.info("Step executable not cached (%s: %s)", type(e).__name__, e)
