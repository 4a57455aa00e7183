"""Multi-host demo on one machine: N CPU processes on 127.0.0.1 form one JAX cluster and serve a
model tensor-parallel over all their devices; process 0 runs the scheduler and broadcasts each step.

    python tools/multihost_demo.py --model PATH [--processes 2] [--devices-per-process 1] \
        [--prompt TEXT ...] [--max-tokens 16] [--compare] [--enable-expert-parallel]

--compare also runs the same prompts in one ordinary process (tensor_parallel_size=1) and exits 1 if
the greedy tokens differ. The last stdout line is JSON: {"tokens": [...], "texts": [...], ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# precompile=False: each process compiles only the buckets the prompts meet, when they meet them
# (the follower on receiving the step), not every bucket up front
ENGINE_KW = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=32,
                 compilation_cache=False, prefix_cache="radix", precompile=False)
DEFAULT_PROMPTS = ["The capital of France is", "JAX is a library for array computation and",
                   "The capital of France is Paris. The capital of Italy is"]


def _generate(llm, prompts, max_tokens):
    from jaxserve import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


def worker(args) -> int:
    from jaxserve.runtime.multihost import LeaderRunner, follower_loop, initialize

    initialize(args.coordinator, args.processes, args.process_id, args.devices_per_process)
    import jax

    from jaxserve import LLM

    tp = jax.device_count()
    t0 = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=tp, enable_expert_parallel=args.enable_expert_parallel, **ENGINE_KW)
    if jax.process_index() == 0:
        leader = LeaderRunner(llm.engine.runner)
        llm.engine.runner = leader
        t1 = time.perf_counter()
        tokens, texts = _generate(llm, args.prompt, args.max_tokens)
        t2 = time.perf_counter()
        leader.shutdown()
        print("RESULT " + json.dumps(dict(
            tokens=tokens, texts=texts, processes=jax.process_count(), devices=jax.device_count(),
            tensor_parallel_size=tp, expert_parallel=args.enable_expert_parallel,
            mesh=str(llm.engine.runner.mesh.shape), steps=llm.engine.counters["steps"],
            start_seconds=t1 - t0, generate_seconds=t2 - t1)), flush=True)
    else:
        steps = follower_loop(llm.engine.runner)
        print(f"process {jax.process_index()}: ran {steps} steps", flush=True)
    jax.distributed.shutdown()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    coord = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # the device count per process comes from --devices-per-process
    base = [sys.executable, __file__, "--model", args.model, "--processes", str(args.processes),
            "--devices-per-process", str(args.devices_per_process), "--max-tokens", str(args.max_tokens),
            "--coordinator", coord, *[a for p in args.prompt for a in ("--prompt", p)],
            *(["--enable-expert-parallel"] if args.enable_expert_parallel else [])]
    procs = [subprocess.Popen(base + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(args.processes)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"multihost demo timed out after {args.timeout}s")
        outs.append((p.returncode, out, err))
    for i, (rc, out, err) in enumerate(outs):
        if rc != 0:
            sys.stderr.write(f"--- process {i} exited {rc}\n{out[-3000:]}\n{err[-5000:]}\n")
            return 1
    line = next(ln for ln in outs[0][1].splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[7:])
    for i, (_, out, _) in enumerate(outs[1:], 1):
        print(out.strip())
    if args.compare:
        from jaxserve import LLM

        ref_tokens, _ = _generate(LLM(args.model, tensor_parallel_size=1, **ENGINE_KW), args.prompt, args.max_tokens)
        result["single_process_tokens_match"] = ref_tokens == result["tokens"]
    print(json.dumps(result))
    return 0 if result.get("single_process_tokens_match", True) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=1)
    p.add_argument("--prompt", action="append", default=None)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture-of-experts model's experts split whole over all processes' devices")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.prompt = args.prompt or DEFAULT_PROMPTS
    return worker(args) if args.process_id is not None else launch(args)


if __name__ == "__main__":
    sys.exit(main())
