"""jax's profiler behind the server's POST /start_profile and /stop_profile (vLLM's admin routes).

One trace at a time per process: the steps between start and stop, written by jax under
`log_dir/plugins/profile/<timestamp>/` as `<host>.xplane.pb` (TensorBoard's or XProf's profile
plugin) and `<host>.trace.json.gz` (Perfetto, chrome://tracing). Started and stopped on the engine
thread between two steps, so a trace holds whole steps.
"""

from __future__ import annotations

import jax

from jaxserve.errors import UserError


class Profiler:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir  # made and checked writable by ServerConfig, at start-up
        self.running = False

    def start(self) -> None:
        if self.running:
            raise UserError("A profile is already running: POST /stop_profile first.", param="profile")
        jax.profiler.start_trace(self.log_dir)
        self.running = True

    def stop(self) -> None:
        if not self.running:
            raise UserError("No profile is running: POST /start_profile first.", param="profile")
        self.running = False
        jax.profiler.stop_trace()  # writes the trace files

    def close(self) -> None:
        """At shutdown: a trace still running is written, not lost."""
        if self.running:
            self.stop()
