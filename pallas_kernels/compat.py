"""The Pallas API spellings that differ between the jax releases the kernels support.

The kernels package runs with jax alone, so its version shims live here (``jaxserve.runtime.compat``
re-exports them for the engine): callers use these names, never a version-specific spelling.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax


def _first(obj: Any, *names: str) -> Any:
    """The first of ``names`` that ``obj`` has (newest spelling first)."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise AttributeError(f"jax {jax.__version__}: {obj!r} has none of {names}")


def tpu_interpret_params() -> Any:
    """Pallas TPU interpreter parameters (``pltpu.InterpretParams``; older: ``TPUInterpretParams``)."""
    from jax.experimental.pallas import tpu as pltpu

    return _first(pltpu, "InterpretParams", "TPUInterpretParams")()


@functools.cache
def gpu_interpret_params() -> Any:
    """The Mosaic GPU interpreter's parameters; the class is private and has moved between
    releases, so look in each place it has lived."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    places = [plgpu]
    for path in (
        "jax._src.pallas.mosaic_gpu.interpret.params",
        "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call",
    ):
        try:
            places.append(importlib.import_module(path))
        except ImportError:
            continue
    for place in places:
        cls = getattr(place, "InterpretGPUParams", None) or getattr(place, "InterpretParams", None)
        if cls is not None:
            return cls()
    raise RuntimeError(f"jax {jax.__version__} has no Mosaic GPU interpreter")


def tpu_hbm() -> Any:
    """The memory space for a Pallas TPU operand left in HBM (``MemorySpace.HBM``; older
    releases spell it ``ANY``)."""
    from jax.experimental.pallas import tpu as pltpu

    return _first(pltpu.MemorySpace, "HBM", "ANY")


def tpu_compiler_params(**kw: Any) -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return _first(pltpu, "CompilerParams", "TPUCompilerParams")(**kw)


def gpu_compiler_params(**kw: Any) -> Any:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return _first(plgpu, "CompilerParams", "GPUCompilerParams")(**kw)
