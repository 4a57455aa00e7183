"""Compile a function for a real TPU with libtpu on any host (nothing executes).

``tpu_compile_check(fn, args, "v5e:2x2")`` runs jax's deviceless TPU compile: Mosaic TPU for every
Pallas kernel inside ``fn`` and XLA:TPU for the rest, against a libtpu topology description
(``jax.experimental.topologies.get_topology_desc``). It needs libtpu (``pip install 'jax[tpu]'``,
the ``jaxserve[compile-tpu]`` extra) and, on a host without a TPU, ``JAX_PLATFORMS=cpu`` so jax
itself does not try to open one. libtpu takes a lock file (``/tmp/libtpu_lockfile``) per process;
set ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` to compile from two processes at once. Usage::

    import jax, jax.numpy as jnp
    from pallas_kernels import compile_check
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), ...)
    r = compile_check.tpu_compile_check(my_fn, args, topology="v6e:2x2")
    r["ok"], r["error"], r["seconds"], r["temp_bytes"]

``args`` are ``jax.ShapeDtypeStruct`` leaves (any pytree); they are placed on the topology's first
device unless ``shardings`` (a pytree of ``NamedSharding``s over ``devices(topology)``) is given.
``static`` keyword arguments are bound with ``functools.partial``. The kernels' own cases (every
shape the project ships, with their VMEM/SMEM estimates) are in ``tpu_cases``; the table is
``bench/tpu_kernel_compile.py``.
"""

from __future__ import annotations

import functools
import time
from typing import Any
from collections.abc import Callable

import jax

CHIPS = ("v5e", "v6e", "v5p", "v7x")


@functools.cache
def devices(topology: str = "v5e:2x2") -> tuple:
    """The (compile-only) devices of a libtpu topology such as ``v5e:2x2`` or ``v6e:2x4``."""
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def _first_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    for line in text.splitlines():  # Mosaic puts the reason on the line naming the failed check
        if "Offsets" in line or "exceed" in line.lower() or "error:" in line.lower():
            return line.strip()[:400]
    return text.splitlines()[0][:400] if text else type(err).__name__


def tpu_compile_check(fn: Callable, args: Any, topology: str = "v5e:2x2", *, shardings: Any = None,
                      static: dict | None = None) -> dict:
    """Compile ``fn(*args)`` for ``topology``; never raises for a compile error.

    Returns ``{"ok", "error" (one line, None when ok), "detail" (the full message), "seconds"
    (wall), "cpu_seconds" (this process's CPU time: steadier on a loaded host), "temp_bytes" (the
    executable's temporaries, memory_analysis), "device_kind"}``."""
    from jax.sharding import SingleDeviceSharding

    t0, c0 = time.perf_counter(), time.process_time()
    out: dict = {"ok": False, "error": None, "detail": None, "seconds": 0.0, "cpu_seconds": 0.0,
                 "temp_bytes": None, "device_kind": None}
    try:
        devs = devices(topology)
        out["device_kind"] = devs[0].device_kind
        if shardings is None:
            shardings = jax.tree.map(lambda _: SingleDeviceSharding(devs[0]), args)
        placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), args,
                              shardings)
        f = functools.partial(fn, **static) if static else fn
        compiled = jax.jit(f).lower(*placed).compile()
        analysis = compiled.memory_analysis()
        out["temp_bytes"] = int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis else None
        out["ok"] = True
    except Exception as err:  # noqa: BLE001 - a compile error is a result here
        out["error"], out["detail"] = _first_line(err), str(err)[:4000]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["cpu_seconds"] = round(time.process_time() - c0, 2)
    return out
