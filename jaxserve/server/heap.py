"""The server's Python heap and the garbage collector: long-lived objects are exempted from
collection, so a full collection walks only what requests allocated.

    freeze_heap()                       # once the server is built (serve, before uvicorn runs)
    aengine.on_idle = FreezeAfterWarmUp(warm)   # again once the background warm-up is done

Start-up leaves ~200k long-lived objects (JAX, the compiled steps, the tokenizer). A full
collection walks every object not frozen with the GIL held, and the objects a burst of requests
allocates trigger one: every stream and /health stall for the whole walk (bench/health_load.py).
The background warm-up (worker/warm_up.py) then compiles the other step buckets while serving and
leaves as many objects again (their jaxprs, lowerings and executables' wrappers): the first full
collection after it took 90-120 ms in the middle of a burst of first tokens (bench/RESULTS.md,
"Tails ... garbage collection"). So the heap is frozen a second time once that warm-up is done, at
the engine thread's next idle moment: no request waits for that collection, and no request's
objects are frozen with it (a frozen cycle is never collected). That second freeze collects only
the young generations (a millisecond or two, against ~100 ms for a full walk, which a request
arriving just then would wait for): what the warm-up left in the old one is frozen as it is, and the
warm-up's own full collections found nothing to free there (bench/RESULTS.md).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("jaxserve")


def freeze_heap(generation: int = 2) -> float:
    """Collect `generation` (and the younger ones), then exempt every object still alive from later
    collections; the seconds it took."""
    t0 = time.perf_counter()
    gc.collect(generation)
    gc.freeze()
    return time.perf_counter() - t0


class FreezeAfterWarmUp:
    """The engine thread's idle hook (AsyncEngine.on_idle): freezes the heap once, the first time
    the engine is idle after `warm` (a BackgroundWarmUp, or None: nothing to wait for) is done."""

    def __init__(self, warm) -> None:
        self.warm = warm

    def __call__(self) -> None:
        if self.warm is None or not self.warm.done:
            return
        self.warm = None
        s = freeze_heap(1)
        log.info("Heap frozen after the background warm-up (%d objects, %.0f ms)", gc.get_freeze_count(), s * 1e3)
