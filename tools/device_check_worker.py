"""One child of tools/device_check.py: runs one phase (or one kernel family of it) and appends its
rows to the shared JSON-lines file. Imports no jax itself: the ``llm`` phase must be the first
thing in its process to start jax (through ``LLM()``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback


class Recorder:
    """Appends one JSON object per line and flushes, so nothing measured is lost."""

    def __init__(self, path: str, unit: str | None = None):
        self.path, self.unit = path, unit
        self.rows: list[dict] = []

    def __call__(self, phase: str, **row) -> dict:
        row = {"phase": phase, "t": round(time.time(), 2), **({"unit": self.unit} if self.unit else {}), **row}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        brief = {k: v for k, v in row.items() if k not in ("phase", "t", "traceback")}
        print(f"[{phase}] {json.dumps(brief, default=str)[:300]}", flush=True)
        return row

    def earlier(self, phase: str) -> list[dict]:
        """Rows other children wrote to the same file (the copy bandwidth, the llm backend)."""
        rows = []
        with open(self.path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r.get("phase") == phase:
                    rows.append(r)
        return rows


def run_worker(opts) -> int:
    if opts.crash:  # tests/test_device_check.py: an abort in a child must cost one row only
        os.kill(os.getpid(), signal.SIGSEGV)
    if opts.hang:
        time.sleep(1e6)
    rec = Recorder(opts.out, opts.unit)
    deadline = time.time() + max(opts.deadline_s, 0)
    try:
        if opts.phase == "llm":
            from tools.device_check_engine import phase_llm

            phase_llm(rec, opts)
            return 0
        from tools import device_check_phases as phases

        phases.configure(opts)
        fn = phases.PHASES[opts.phase]
        fn(rec, opts) if opts.phase == "env" else fn(rec, opts, deadline)
    except Exception as e:  # noqa: BLE001 -- recorded; the parent goes on to the next child
        rec(opts.phase, ok=False, error=f"{type(e).__name__}: {e}"[:1500],
            traceback=traceback.format_exc()[-3000:])
    sys.stdout.flush()
    return 0
