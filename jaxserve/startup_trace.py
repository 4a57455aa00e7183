"""Start-up phases, for `jaxserve bench startup`: named marks from process start to serving.

    startup_trace.mark("tokenizer")                   # the phase that just ended
    startup_trace.mark("compile", bucket="...", s=1.2)  # one event with its own duration

With `JAXSERVE_STARTUP_TRACE=<file>` each mark is appended to the file as one JSON line
`{"phase": ..., "t": <wall clock>, ...}` (wall clock, so the parent that spawned the process can
subtract its spawn time); without it a mark costs one environment lookup. Imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "JAXSERVE_STARTUP_TRACE"
_lock = threading.Lock()  # background compiles mark from their threads


def mark(phase: str, **extra) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"phase": phase, "t": time.time(), **extra})
    with _lock, open(path, "a") as f:
        f.write(line + "\n")


def read(path: str) -> list[dict]:
    """The marks written to `path` (in order)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
