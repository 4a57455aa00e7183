"""A default Pallas attention backend whose kernels the device's compiler rejects: warn once and
serve on `xla`, never die at start-up over a kernel.

`resolve_backend` picks Pallas on GPU and TPU from what the kernel gate admits (shapes, dtypes,
compute capability), but only the real compiler (ptxas, Mosaic TPU) knows a register or VMEM limit
for sure. When a bucket's step fails to compile, `fall_back` switches the runner to the `xla`
attention backend, with its KV layout, and the bucket compiles again. A Pallas backend the user
asked for (`--attention-backend pallas`) gets the compiler's error instead. Switching KV layout
(TPU's fused pages to xla's paged ones) is safe only while the cache holds nothing: after the
first step it is an error naming the flag, never a silent loss of cached KV. The runner's batch
builder takes the fallback's bucket dimensions (xla's context widths, no decode buckets).
"""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger("jaxserve")


def fall_back(runner, generation: int, error: Exception) -> bool:
    """Switch ``runner`` to its backend's fallback after ``error`` compiling a step under the
    backend of ``generation``; True when the caller should compile again, False to re-raise."""
    with runner._fallback_lock:
        if runner._generation != generation:  # another bucket's failure switched it already
            return True
        old = runner.backend
        if old.fallback is None:
            return False
        layout = "paged"
        if layout != old.kv_layout and runner.steps_run:
            raise RuntimeError(
                f"the {old.attention} attention kernels failed to compile after serving had begun, and the "
                f"{old.fallback} backend needs another KV layout: start with --attention-backend "
                f"{old.fallback} (or keep precompile on, so every bucket compiles before the first "
                f"request). Compiler error: {_first_line(error)}") from error
        log.warning("The %s attention kernels failed to compile on %s (%s); serving with the '%s' "
                    "attention backend instead (pass --attention-backend %s to skip this attempt).",
                    old.attention, old.platform, _first_line(error), old.fallback, old.fallback)
        new = dataclasses.replace(old, attention=old.fallback, kv_layout=layout, fallback=None,
                                  reason=f"{old.attention} failed to compile: {_first_line(error)}")
        runner._use_backend(new, allocate=runner.kv is not None)  # a device's cache may wait (resize_kv)
        runner.drop_executables()
        runner._generation += 1
        return True


def _first_line(error: Exception, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= limit else text[:limit] + "..."
