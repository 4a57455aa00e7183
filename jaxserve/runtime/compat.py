"""Every jax API whose spelling differs between the jax releases we support (0.10.x, 0.11.x).

One place to look when a jax upgrade breaks an import: callers use these names, never the
version-specific spellings. Also the check that jax is not silently running on CPU on a machine
with an accelerator (the usual result of ``pip install jaxserve`` without a platform extra).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax

logger = logging.getLogger(__name__)

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# The FFI moved from jax.extend.ffi to jax.ffi (0.4.35); keep one alias for our native calls.
ffi = jax.ffi if hasattr(jax, "ffi") else importlib.import_module("jax.extend.ffi")


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



# --- an accelerator jax does not use -------------------------------------------------------


def probe_accelerators() -> dict[str, bool]:
    """Which accelerator device files this host has (cheap: a glob, no driver call)."""
    return {
        "nvidia": bool(glob.glob("/dev/nvidia[0-9]*")),
        "tpu": bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")),
    }


# The plugin modules jax loads for each kind of accelerator (the CUDA 13 and 12 plugins, libtpu).
PLUGIN_MODULES = {"nvidia": ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"), "tpu": ("libtpu",)}
JAX_PLATFORM = {"nvidia": "cuda", "tpu": "tpu"}


class _PluginErrors(logging.Handler):
    """Keeps the last error jax logged while loading each plugin module: jax logs a plugin whose
    ``initialize()`` raised (jaxlib refusing the allocator settings, a driver mismatch) and carries
    on without it, so without this the engine could only say "install"."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.errors: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "plugin" not in text.lower():
            return
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            text = f"{type(e).__name__}: {e}"
        for kind, modules in PLUGIN_MODULES.items():
            if any(m.rsplit(".", 1)[-1] in record.getMessage() for m in modules):
                self.errors[kind] = text


_plugin_errors = _PluginErrors()
logging.getLogger("jax._src.xla_bridge").addHandler(_plugin_errors)


def plugin_state(kind: str) -> tuple[str | None, str | None]:
    """(the installed plugin module for ``kind`` or None, why jax could not start it or None)."""
    import importlib.util

    from jax._src import xla_bridge

    installed = None
    for name in PLUGIN_MODULES[kind]:
        try:
            if importlib.util.find_spec(name) is not None:
                installed = name
                break
        except (ImportError, ValueError):
            continue
    platform = JAX_PLATFORM[kind]
    error = getattr(xla_bridge, "_backend_errors", {}).get(platform) or _plugin_errors.errors.get(kind)
    if installed and not error and platform not in getattr(xla_bridge, "_backend_factories", {platform: 0}):
        error = "its initialize() failed (see jax's log above: 'Jax plugin configuration error')"
    return installed, error


def accelerator_hint(platform: str, devices: dict[str, bool],
                     state: Callable[[str], tuple[str | None, str | None]] = plugin_state) -> str | None:
    """The message for jax on ``platform`` while ``devices`` shows unused hardware, else None:
    the plugin is missing (install it) or installed and failed to start (its error)."""
    if platform != "cpu":
        return None
    check = "then check `python -c 'import jax; print(jax.devices())'`"
    if devices.get("nvidia"):
        where = "an NVIDIA GPU is present (/dev/nvidia*) but jax runs on CPU"
        installed, error = state("nvidia")
        if installed:
            return (f"{where}: the CUDA plugin ({installed}) is installed but failed to initialise: "
                    f"{error or 'no error recorded'}; "
                    "fix that (driver version, XLA_*_MEM_FRACTION settings, JAX_PLATFORMS), " + check)
        return (
            f"{where}: the CUDA plugin is not installed: install it "
            "with `pip install 'jaxserve[cuda13]'` (driver >= 580) or "
            f"`pip install 'jaxserve[cuda12]'` (driver >= 525), {check}"
        )
    if devices.get("tpu"):
        where = "a TPU is present (/dev/accel* or /dev/vfio) but jax runs on CPU"
        installed, error = state("tpu")
        if installed:
            return (f"{where}: libtpu is installed but failed to initialise: {error or 'no error recorded'}; "
                    "fix that (another process holding the TPU, JAX_PLATFORMS), " + check)
        return f"{where}: libtpu is not installed: install it with `pip install 'jaxserve[tpu]'`, {check}"
    return None


def warn_if_accelerator_unused(
    probe: Callable[[], dict[str, bool]] = probe_accelerators, platform: str | None = None,
    state: Callable[[str], tuple[str | None, str | None]] = plugin_state,
) -> str | None:
    """Log an error (and return it) when jax runs on CPU on a host with a GPU or TPU.

    Called once at engine start; ``probe``/``platform``/``state`` are parameters so a test can
    fake them.
    """
    message = accelerator_hint(platform or jax.default_backend(), probe(), state)
    if message:
        logger.error(message)
    return message


# --- Mosaic GPU internals read by the deviceless compile (runtime/deviceless.py) ---------------


@contextlib.contextmanager
def mosaic_gpu_smem_sizes() -> Iterator[list[int]]:
    """The dynamic shared memory (bytes) each Mosaic GPU kernel is launched with, recorded as
    kernels are lowered inside the block. ptxas reports only static shared memory, and Mosaic
    GPU's launch helper (private, ``core._launch``) is where the size is decided; where it is
    missing the list stays empty."""
    sizes: list[int] = []
    try:
        from jax.experimental.mosaic.gpu import core
    except ImportError:
        yield sizes
        return
    launch, tree_size = getattr(core, "_launch", None), getattr(core, "_smem_tree_size", None)
    if launch is None or tree_size is None:
        yield sizes
        return

    def recording(token, grid, cluster, block, smem_buffers, *args, **kwargs):
        sizes.append(int(tree_size(smem_buffers)))
        return launch(token, grid, cluster, block, smem_buffers, *args, **kwargs)

    core._launch = recording
    try:
        yield sizes
    finally:
        core._launch = launch
