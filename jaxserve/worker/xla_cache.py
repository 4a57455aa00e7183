"""XLA's persistent compilation cache: where it lives, and its hits and misses counted (the
runner's precompile warns when a start compiled what the cache should have held)."""

from __future__ import annotations

import os

import jax

from jaxserve.paths import cache_dir

EVENTS = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}


def _count_cache_event(event: str, **kw) -> None:
    if event in EVENTS:
        EVENTS[event] += 1


def enable(path: str | None = None) -> str:
    path = path or os.environ.get("JAXSERVE_COMPILATION_CACHE") or str(cache_dir() / "xla")
    if not getattr(enable, "listening", False):
        jax.monitoring.register_event_listener(_count_cache_event)  # see precompile's log line
        enable.listening = True
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
