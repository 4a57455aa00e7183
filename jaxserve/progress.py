"""Progress for long start-up work (compiling step buckets) and offline batches.

On a terminal: a tqdm bar. Anywhere else (a service log, CI), a line per milestone (every 25%,
and the last item) instead of carriage-return redraws that fill a log file with noise.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("jaxserve")


def _interactive() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def compile_progress():
    """A callback(done, total, bucket) for `precompile`: one bar or milestone lines over buckets."""
    state: dict = {}

    def update(done: int, total: int, bucket) -> None:
        if _interactive():
            if "bar" not in state:
                from tqdm.auto import tqdm

                state["bar"] = tqdm(total=total, desc="Compiling step buckets", unit="bucket", dynamic_ncols=True)
            bar = state["bar"]
            bar.set_postfix_str(f"tokens={bucket[0]} seqs={bucket[1]}" + (f" adjust={bucket[2]}" if bucket[2] else ""))
            bar.update(1)
            if done == total:
                bar.close()
            return
        t0 = state.setdefault("t0", time.perf_counter())
        step = max(1, total // 4)
        if done == total or done % step == 0:
            log.info("Compiling step buckets: %d/%d (%.1f s)", done, total, time.perf_counter() - t0)

    return update
