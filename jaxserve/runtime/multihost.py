"""Multi-host serving: one process per host, one global mesh, the scheduler on process 0.

JAX runs SPMD across processes: every process must launch the same compiled step, with the same
(global) inputs, in the same order. The engine's host side (scheduler, prefix cache, detokenizer)
is not deterministic across processes (arrival times, the HTTP server), so only process 0 runs it:

    process 0 (leader)                          processes 1..N-1 (followers)
    LLMEngine(...)                              LLMEngine(...)          # same model, same mesh
    engine.runner = LeaderRunner(engine.runner) follower_loop(engine.runner)
    ... engine.step() ...                         <- each step: header + the packed batch (broadcast)
      runner.execute(batch) -> broadcast, run      runner.execute(buffer)  # same step, same inputs
    leader.shutdown()                             <- stop header; loop returns

The broadcast is `multihost_utils.broadcast_one_to_all`, a tiny collective over the same devices
(on CPU: gloo over TCP; on TPU pods / GPU clusters the platform's interconnect). Sampled tokens are
replicated, so the leader reads them from its own devices.

Start each process with `initialize()` (wraps `jax.distributed.initialize`) before anything else
touches JAX. See tools/multihost.md.
"""

from __future__ import annotations

import os

import numpy as np

from jaxserve.core.batch import StepBatch
from jaxserve.core.buckets import BucketKey

_STOP, _STEP = 0, 1
_HEADER = 7  # cmd, T, S, W, decode, pool, C


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None) -> None:
    """`jax.distributed.initialize`, plus CPU specifics: gloo collectives over TCP and, optionally,
    `local_device_count` forced CPU devices per process. Arguments default to the environment
    (JAXSERVE_COORDINATOR, JAXSERVE_NUM_PROCESSES, JAXSERVE_PROCESS_ID); on TPU pods and managed
    GPU clusters JAX can discover them itself (pass nothing)."""
    import jax

    env = os.environ
    coordinator_address = coordinator_address or env.get("JAXSERVE_COORDINATOR")
    if num_processes is None and env.get("JAXSERVE_NUM_PROCESSES"):
        num_processes = int(env["JAXSERVE_NUM_PROCESSES"])
    if process_id is None and env.get("JAXSERVE_PROCESS_ID"):
        process_id = int(env["JAXSERVE_PROCESS_ID"])
    platforms = (env.get("JAX_PLATFORMS") or "").lower()
    if local_device_count:
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    if platforms in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def _header(cmd: int, key: BucketKey | None = None) -> np.ndarray:
    h = np.zeros(_HEADER, np.int64)
    h[0] = cmd
    if key is not None:
        h[1:] = key
    return h


class LeaderRunner:
    """Wraps process 0's ModelRunner: every step's packed batch is broadcast to the followers,
    then run."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, batch: StepBatch, key: BucketKey):
        flat = batch.pack()
        _broadcast(_header(_STEP, key))
        _broadcast(flat)
        return self._runner.execute(flat, key)

    def shutdown(self) -> None:
        _broadcast(_header(_STOP))


def follower_loop(runner) -> int:
    """Run the steps process 0 broadcasts until it shuts down. Returns the number of steps run."""
    steps = 0
    while True:
        h = np.asarray(_broadcast(_header(_STOP)))
        if int(h[0]) == _STOP:
            return steps
        key = BucketKey(int(h[1]), int(h[2]), int(h[3]), bool(h[4]), bool(h[5]), int(h[6]))
        flat = np.asarray(_broadcast(np.zeros(runner.builder.packed_size(key), np.int32)))
        result = runner.execute(flat, key)
        runner.fetch(result, key.s, True, True)  # keep in lock step with the leader
        steps += 1
