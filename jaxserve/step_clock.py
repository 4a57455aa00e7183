"""What the engine measures about its steps: host time per engine call besides the device wait,
that wait, and whether a dispatched step was queued behind a busy device (bench/host_overhead.py
reads these as `engine.timing`); the gap between steps read back, fed to the ITL budget
(core/step_budget.py, which caps the prefill tokens scheduled next to decodes); and, when
`JAXSERVE_STEP_TRACE` is set, one trace line per step (step_trace.py)."""

from __future__ import annotations

import time

from jaxserve.core.step_budget import StepBudget
from jaxserve.step_trace import StepTrace


class StepClock:
    def __init__(self, max_num_batched_tokens: int, itl_target_ms: float | None):
        self.budget = StepBudget(max_num_batched_tokens, None if itl_target_ms is None else itl_target_ms / 1e3)
        self.trace = StepTrace.from_env()  # None unless JAXSERVE_STEP_TRACE names a file
        # host time in step() besides the device wait; that wait; steps dispatched while the step before
        # still ran on the device (their host time hidden) / onto an idle one
        self.timing = dict(host_s=0.0, device_wait_s=0.0, steps=0, dispatch_busy=0, dispatch_idle=0)
        self.host_s = 0.0  # the last engine call's host time (traced with the step it reads next)
        self._t0 = self._wait0 = 0.0
        self._last_read: float | None = None  # None: the engine went idle since

    def prefill_cap(self) -> int | None:
        return self.budget.cap()

    def begin(self) -> None:
        """At the start of an engine step() call."""
        self._t0, self._wait0 = time.perf_counter(), self.timing["device_wait_s"]

    def end(self, idle: bool) -> None:
        """At its end; idle: nothing is in flight, so the next step's gap would include idle time."""
        t = self.timing
        self.host_s = time.perf_counter() - self._t0 - (t["device_wait_s"] - self._wait0)
        t["host_s"] += self.host_s
        t["steps"] += 1
        if idle:
            self._last_read = None
            if self.trace is not None:
                self.trace.idle()

    def queued(self, busy: bool) -> None:
        self.timing["dispatch_busy" if busy else "dispatch_idle"] += 1

    def dispatched(self, step) -> None:
        if self.trace is not None:
            step.dispatched = self.trace.now()

    def read(self, step, scheduler, waited_s: float) -> None:
        """A dispatched step's arrays arrived after waiting `waited_s` (before its requests update)."""
        self.timing["device_wait_s"] += waited_s
        now, sched = time.perf_counter(), step.sched
        if self._last_read is not None and sched.num_decode_tokens:
            self.budget.observe(sched.num_prefill_tokens, now - self._last_read)
        self._last_read = now
        if self.trace is not None:
            self.trace.record(step=sched.step, key=step.key, prefill=sched.num_prefill_tokens,
                              decode=sched.num_decode_tokens, dispatched=step.dispatched, host_s=self.host_s,
                              prefill_cap=sched.prefill_cap, running=scheduler.num_running,
                              waiting=scheduler.num_waiting)
