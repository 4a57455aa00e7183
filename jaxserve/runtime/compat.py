"""Every jax API whose spelling differs between the jax releases we support (0.10.x, 0.11.x).

One place to look when a jax upgrade breaks an import: callers use these names, never the
version-specific spellings. Also the check that jax is not silently running on CPU on a machine
with an accelerator (the usual result of ``pip install jaxserve`` without a platform extra).
"""

from __future__ import annotations

import glob
import importlib
import logging
from collections.abc import Callable
from typing import Any

import jax

logger = logging.getLogger(__name__)

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# The FFI moved from jax.extend.ffi to jax.ffi (0.4.35); keep one alias for our native calls.
ffi = jax.ffi if hasattr(jax, "ffi") else importlib.import_module("jax.extend.ffi")


def _first(obj: Any, *names: str) -> Any:
    """The first of ``names`` that ``obj`` has (newest spelling first)."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise AttributeError(f"jax {jax.__version__}: {obj!r} has none of {names}")


def backends_started() -> bool:
    """Whether jax has created its backends (after which allocator settings no longer apply)."""
    from jax._src import xla_bridge

    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if probe is not None else bool(getattr(xla_bridge, "_backends", None))


def memory_stats(device: Any) -> dict[str, int] | None:
    """The device allocator's stats (``bytes_limit``, ``bytes_in_use``...), None where the
    backend keeps none (CPU) or the method is missing."""
    fn = getattr(device, "memory_stats", None)
    try:
        stats = fn() if fn is not None else None
    except (RuntimeError, NotImplementedError):  # some plugins raise instead of returning None
        return None
    return dict(stats) if stats else None


def compute_capability(device: Any) -> str | None:
    """A CUDA device's compute capability (``"9.0"``), None elsewhere or where unreported."""
    cc = getattr(device, "compute_capability", None)
    return str(cc) if cc else None


def peak_temp_bytes(compiled: Any) -> int:
    """Peak temporary (scratch) bytes of a compiled executable, from XLA's memory analysis.

    ``compiled.memory_analysis()`` returns a ``CompiledMemoryStats`` (one per device program;
    some versions a list of them) or None where the backend does not report it (then 0).
    """
    analysis = compiled.memory_analysis()
    if isinstance(analysis, (list, tuple)):
        return max((peak_temp_bytes_of(a) for a in analysis), default=0)
    return peak_temp_bytes_of(analysis)


def peak_temp_bytes_of(analysis: Any) -> int:
    if analysis is None:
        return 0
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


def export(fn: Callable, platforms: list[str]) -> Callable:
    """``jax.export.export`` (a module since 0.4.30; before that jax.experimental.export)."""
    mod = getattr(jax, "export", None) or importlib.import_module("jax.experimental.export")
    return mod.export(fn, platforms=platforms)


# The Pallas shims live with the kernels (which import nothing from jaxserve); re-exported here.
from pallas_kernels.compat import (  # noqa: E402, F401
    gpu_compiler_params,
    gpu_interpret_params,
    tpu_compiler_params,
    tpu_hbm,
    tpu_interpret_params,
)


# --- an accelerator jax does not use -------------------------------------------------------


def probe_accelerators() -> dict[str, bool]:
    """Which accelerator device files this host has (cheap: a glob, no driver call)."""
    return {
        "nvidia": bool(glob.glob("/dev/nvidia[0-9]*")),
        "tpu": bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")),
    }


def accelerator_hint(platform: str, devices: dict[str, bool]) -> str | None:
    """The message for jax on ``platform`` while ``devices`` shows unused hardware, else None."""
    if platform != "cpu":
        return None
    if devices.get("nvidia"):
        return (
            "an NVIDIA GPU is present (/dev/nvidia*) but jax runs on CPU: install the CUDA "
            "plugin with `pip install 'jaxserve[cuda13]'` (driver >= 580) or "
            "`pip install 'jaxserve[cuda12]'` (driver >= 525), then check "
            "`python -c 'import jax; print(jax.devices())'`"
        )
    if devices.get("tpu"):
        return (
            "a TPU is present (/dev/accel* or /dev/vfio) but jax runs on CPU: install libtpu "
            "with `pip install 'jaxserve[tpu]'`, then check "
            "`python -c 'import jax; print(jax.devices())'`"
        )
    return None


def warn_if_accelerator_unused(
    probe: Callable[[], dict[str, bool]] = probe_accelerators, platform: str | None = None
) -> str | None:
    """Log an error (and return it) when jax runs on CPU on a host with a GPU or TPU.

    Called once at engine start; ``probe``/``platform`` are parameters so a test can fake them.
    """
    message = accelerator_hint(platform or jax.default_backend(), probe())
    if message:
        logger.error(message)
    return message
