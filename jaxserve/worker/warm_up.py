"""`jaxserve serve`'s background warm-up: ready after one compile, the other buckets compiled while
serving, and no step ever waiting on a compile.

    warm = warm_up(engine, progress)   # the largest bucket now, then a thread (None: all compiled now)
    ...                                                     # steps meanwhile: BatchBuilder.ready
    warm.stop()                                             # before exit: after the current bucket

The largest bucket holds any step (padding fills the rest), so it is compiled first, before the
server says it is healthy. The others compile on one thread, smallest first (decode steps' small
buckets are the common ones); until a step's own bucket is in, the batch builder runs it in the
smallest compiled bucket that holds it (core/buckets.covering_bucket). Then the freed compile heap
is handed back (runtime/memory.trim_heap).
"""

from __future__ import annotations

import logging
import threading
import time

from jaxserve.runtime import memory
from jaxserve.startup_trace import mark

log = logging.getLogger("jaxserve")


def warm_up(engine, progress=None) -> BackgroundWarmUp | None:
    """`serve`'s start-up compile: the largest bucket now and the rest in the background (returns
    the BackgroundWarmUp), or every bucket now (engine.precompile) where background_compile is off
    or pooling / draft steps compile too (returns None)."""
    if not engine.config.background_compile or engine.pooling_config.declared or engine.drafter is not None:
        engine.precompile(progress)
        return None
    warm = BackgroundWarmUp(engine.runner)
    warm.start(progress)
    mark("precompile")
    return warm


class BackgroundWarmUp:
    def __init__(self, runner):
        self.runner = runner
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, progress=None) -> bool:
        """Compile the largest bucket, then start the thread for the rest; False if none is left."""
        runner = self.runner
        keys = runner.all_buckets()
        runner.precompile(progress, keys=[max(keys)])
        rest = sorted(k for k in keys if k not in runner._compiled)
        if not rest:
            return False
        runner.builder.ready = runner._compiled  # read by the engine thread while this one adds to it
        self.thread = threading.Thread(target=self._run, args=(rest,), name="jaxserve-warm-up", daemon=True)
        self.thread.start()
        return True

    def _run(self, rest) -> None:
        t0 = time.perf_counter()
        for key in rest:
            if self._stop.is_set():
                return
            self.runner.executable(key)
        self.runner.builder.ready = None  # every bucket compiled
        memory.trim_heap()
        log.info("Background warm-up: %d step buckets compiled in %.1f s", len(rest), time.perf_counter() - t0)
        mark("warm-up done")

    @property
    def done(self) -> bool:
        """Every bucket compiled (server/heap.py freezes the heap after it)."""
        return self.runner.builder.ready is None

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """End after the bucket being compiled (a compile thread left running while the interpreter
        finalizes can crash it)."""
        self._stop.set()
        self.join(timeout)
