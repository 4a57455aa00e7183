"""XLA's persistent compilation cache: where it lives, and its hits and misses counted (the
runner's precompile warns when a start compiled what the cache should have held; the step cache
asks whether a compile on its thread was served from here: worker/step_cache.py)."""

from __future__ import annotations

import os
import threading

import jax

from jaxserve.paths import cache_dir

HIT = "/jax/compilation_cache/cache_hits"
EVENTS = {HIT: 0, "/jax/compilation_cache/cache_misses": 0}
_thread = threading.local()  # each thread's hits (jax records them on the compiling thread)


def _count_cache_event(event: str, **kw) -> None:
    if event in EVENTS:
        EVENTS[event] += 1
        if event == HIT:
            _thread.hits = getattr(_thread, "hits", 0) + 1


# counted from import on: the cache may be on by jax's own settings too (JAX_COMPILATION_CACHE_DIR)
jax.monitoring.register_event_listener(_count_cache_event)  # see precompile's log line


def thread_hits() -> int:
    """The persistent cache's hits on the calling thread so far: a compile that raised it was
    served a deserialized executable (worker/step_cache.py must not serialize that one again)."""
    return getattr(_thread, "hits", 0)


def enable(path: str | None = None) -> str:
    path = path or os.environ.get("JAXSERVE_COMPILATION_CACHE") or str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
