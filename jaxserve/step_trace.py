"""A per-step trace for finding latency spikes: one JSON line per engine step read back.

Set `JAXSERVE_STEP_TRACE=/path/steps.jsonl` (the server and `LLM` both honour it) and each step the
engine reads back writes: its index, bucket (t, s), prefill tokens and decode rows, when it was
dispatched and read (seconds since the trace began), `gap_s` = time since the step before was read
(what a decoding stream sees as its inter-token latency while the engine is busy), the host time of
the engine call that read it, garbage-collection pauses in between, the prefill cap in force, and
whether the step compiled (a bucket seen for the first time). `bench/step_trace.py` turns the file
into a table of where the time went. Off (no cost) when the variable is unset.
"""

from __future__ import annotations

import gc
import json
import os
import time

ENV = "JAXSERVE_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str):
        self._f = open(path, "w", buffering=1 << 16)  # noqa: SIM115 - lives as long as the engine
        self._t0 = time.perf_counter()
        self._last_read = None
        self._gc_s = 0.0
        self._gc_start = 0.0
        self._seen: set = set()
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def record(self, *, step: int, key, prefill: int, decode: int, dispatched: float, host_s: float,
               prefill_cap: int | None, running: int, waiting: int) -> None:
        t = self.now()
        bucket = (getattr(key, "t", None), getattr(key, "s", None))
        new_bucket = key not in self._seen
        self._seen.add(key)
        row = dict(step=step, t=bucket[0], s=bucket[1], prefill=prefill, decode=decode,
                   dispatched=round(dispatched, 6), read=round(t, 6),
                   gap_s=None if self._last_read is None else round(t - self._last_read, 6),
                   host_s=round(host_s, 6), gc_s=round(self._gc_s, 6), new_bucket=new_bucket,
                   prefill_cap=prefill_cap, running=running, waiting=waiting)
        self._gc_s = 0.0
        self._last_read = t
        self._f.write(json.dumps(row) + "\n")

    def idle(self) -> None:
        """The engine ran out of work: the next step's gap is not an inter-token latency."""
        self._last_read = None
        self._f.flush()

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._f.close()
