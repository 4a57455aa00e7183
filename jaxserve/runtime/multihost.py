"""Multi-host serving: one process per host, one global mesh, the scheduler on process 0.

JAX runs SPMD across processes: every process must launch the same compiled step, with the same
(global) inputs, in the same order. The engine's host side (scheduler, prefix cache, detokenizer)
is not deterministic across processes (arrival times, the HTTP server), so only process 0 runs it:

    process 0 (leader)                          processes 1..N-1 (followers)
    LLMEngine(...)                              LLMEngine(...)          # same model, same mesh
    engine.runner = LeaderRunner(engine.runner) follower_loop(engine.runner)
    ... engine.step() ...                         <- each step: header + batch arrays (broadcast)
      runner.execute(batch) -> broadcast, run      runner.execute(batch)  # same step, same inputs
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

from jaxserve.runtime.input_batch import StepInputs
from jaxserve.runtime.sampler import SamplingMode

_STOP, _STEP = 0, 1
_HEADER = 10  # cmd, T, S, all_greedy, truncation, lo, lp, bias_width, num_logprobs, num_tokens
_TENSOR_FIELDS = (
    ("temperature", np.float32, "s"), ("top_k", np.int32, "s"), ("top_p", np.float32, "s"),
    ("min_p", np.float32, "s"), ("seeds", np.uint32, "s"), ("steps", np.int32, "s"),
    ("presence", np.float32, "s"), ("frequency", np.float32, "s"), ("repetition", np.float32, "s"),
    ("output_ids", np.int32, "lo"), ("prompt_ids", np.int32, "lp"), ("bias_ids", np.int32, "a"),
    ("bias_values", np.float32, "a"),
)


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


def _header(cmd: int, t=0, s=0, mode: SamplingMode | None = None, num_tokens=0) -> np.ndarray:
    h = np.zeros(_HEADER, np.int64)
    h[0], h[1], h[2], h[9] = cmd, t, s, num_tokens
    if mode is not None:
        h[3:9] = (mode.all_greedy, mode.truncation, *mode.penalty_widths, mode.bias_width, mode.num_logprobs)
    return h


def _empty_payload(h: np.ndarray, max_blocks: int):
    t, s, lo, lp, a = int(h[1]), int(h[2]), int(h[5]), int(h[6]), int(h[7])
    dims = {"s": (s,), "lo": (s, lo), "lp": (s, lp), "a": (s, a)}
    inputs = dict(input_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                  slot_mapping=np.zeros(t, np.int32), seq_lens=np.zeros(s, np.int32),
                  query_start_loc=np.zeros(s + 1, np.int32), block_tables=np.zeros((s, max_blocks), np.int32),
                  num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(s, np.int32))
    tensors = {name: np.zeros(dims[d], dt) for name, dt, d in _TENSOR_FIELDS}
    return inputs, tensors


def _mode(h: np.ndarray) -> SamplingMode:
    return SamplingMode(all_greedy=bool(h[3]), truncation=bool(h[4]), penalty_widths=(int(h[5]), int(h[6])),
                        bias_width=int(h[7]), num_logprobs=int(h[8]))


class LeaderRunner:
    """Wraps process 0's ModelRunner: every step is broadcast to the followers, then run."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, inputs: StepInputs, t: int, s: int, tensors: dict, mode: SamplingMode):
        _broadcast(_header(_STEP, t, s, mode, inputs.num_tokens))
        fields = {k: getattr(inputs, k) for k in _empty_payload(_header(_STEP, t, s, mode), 1)[0]}
        tensors = {name: np.asarray(tensors[name], dt) for name, dt, _ in _TENSOR_FIELDS}
        _broadcast((fields, tensors))
        return self._runner.execute(inputs, t, s, tensors, mode)

    def shutdown(self) -> None:
        _broadcast(_header(_STOP))


def follower_loop(runner) -> int:
    """Run the steps process 0 broadcasts until it shuts down. Returns the number of steps run."""
    steps = 0
    while True:
        h = np.asarray(_broadcast(_header(_STOP)))
        if int(h[0]) == _STOP:
            return steps
        inputs, tensors = _empty_payload(h, runner.max_blocks)
        inputs, tensors = _broadcast((inputs, tensors))
        inputs = {k: np.asarray(v) for k, v in inputs.items()}
        tensors = {k: np.asarray(v) for k, v in tensors.items()}
        result = runner.execute(StepInputs(**inputs, num_tokens=int(h[9])), int(h[1]), int(h[2]), tensors, _mode(h))
        runner.fetch(result)  # keep in lock step with the leader (it reads the tokens every step)
        steps += 1
