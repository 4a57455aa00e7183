"""Host time per engine step at N running requests: what the device does not hide.

`jaxserve bench host_overhead --running 64,256 --out bench/out/host_overhead.json`

N requests decode together (the default model unless --model; prompts of --prompt-len tokens,
greedy, ignore_eos). Per steady decode step it reports the engine's host time (scheduling, the
batch builder, dispatch, reading the tokens, stops, detokenization, outputs: everything in
step() but the wait for the device), the wait, and the wall time, with one step in flight
(--async-scheduling, the default) and without. Without overlap the device idles for all the host
time; with it, only for what exceeds the device's step: `exposed ms` = wall per step minus the
device's own step time, measured by replaying the same decode batch back to back with no host
work in between. `host cpu ms` is the engine thread's CPU time per step (time.thread_time), which
other processes on the machine do not inflate the way they inflate wall times.

`hidden` is measured without timing noise: the share of steps the engine dispatched while the step
before was still running on the device (`jax.Array.is_ready()` false right after the new step was
queued), so that none of their host time reached the device. `exposed bound ms` = for the other
steps, their host time and the step before's, per step: an upper bound on what the device waited
for (the device can have gone idle no earlier than during the previous step's host work).
"""

from __future__ import annotations

import argparse
import time

from bench import common


def run(llm, n: int, prompt_len: int, steps: int) -> dict:
    from jaxserve import SamplingParams

    eng = llm.engine
    vocab = eng.model_config.vocab_size
    # Long enough that no request ends before the timed steps are over: the prefill of N prompts
    # takes N x prompt_len / max_num_batched_tokens steps, in which the first ones already decode.
    p = SamplingParams(max_tokens=HEADROOM, temperature=0, ignore_eos=True)  # aborted after the timed steps
    for i in range(n):
        eng.add_request(f"h{n}-{i}", None, p, prompt_token_ids=[(7 * i + j) % (vocab - 10) + 5
                                                                 for j in range(prompt_len)])
    while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()  # prefill everyone
    for _ in range(3):
        eng.step()
    t = eng.timing
    h0, w0, s0, t0, c0 = t["host_s"], t["device_wait_s"], t["steps"], time.perf_counter(), time.thread_time()
    b0, i0, host_idle = t["dispatch_busy"], t["dispatch_idle"], 0.0
    rows = len(eng.scheduler.running)
    last = 0.0  # the previous step's host seconds
    for _ in range(steps):
        h, idle = t["host_s"], t["dispatch_idle"]
        eng.step()
        if t["dispatch_idle"] != idle:
            host_idle += t["host_s"] - h + last
        last = t["host_s"] - h
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    k = t["steps"] - s0
    assert rows == n == len(eng.scheduler.running), (n, rows, len(eng.scheduler.running))
    device = device_step_s(eng, steps)
    for i in range(n):
        eng.abort_request(f"h{n}-{i}")
    while eng.has_unfinished_requests():
        eng.step()
    return {"running": n, "steps": k, "host_ms": 1e3 * (t["host_s"] - h0) / k, "host_cpu_ms": 1e3 * cpu / k,
            "device_wait_ms": 1e3 * (t["device_wait_s"] - w0) / k, "wall_ms": 1e3 * wall / k,
            "device_step_ms": 1e3 * device, "exposed_ms": max(0.0, 1e3 * (wall / k - device)),
            "dispatched_busy": t["dispatch_busy"] - b0, "dispatched_idle": t["dispatch_idle"] - i0,
            "hidden_share": (t["dispatch_busy"] - b0) / k, "exposed_bound_ms": 1e3 * host_idle / k}


# output tokens a request may reach: none ends before the timed steps, however many steps the
# prefill of every prompt takes (the ITL-aware prefill cap spreads it over more steps)
HEADROOM = 512


def device_step_s(eng, steps: int) -> float:
    """The device's own time for one decode step of the running requests: the same batch (each
    request's newest token already in the cache, greedy) replayed back to back, nothing on the
    host in between: it rewrites that token's K/V with the same values."""
    import jax

    from jaxserve.core.batch import RowSpec, Sampling

    if eng._inflight is not None:  # read the step in flight, dispatching no other
        eng._process(eng._inflight, {})
        eng._inflight = None
    rows = [RowSpec(r.token_ids[:r.num_computed_tokens], r.num_computed_tokens - 1, 1, r.block_ids,
                    Sampling(), -1) for r in eng.scheduler.running]
    runner = eng.runner
    batch, key, _ = runner.builder.build(rows)
    jax.block_until_ready(runner.execute(batch, key))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = runner.execute(batch, key)
        jax.block_until_ready(out.tokens)
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--running", default="64,256", help="comma-separated running-request counts")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per level")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from jaxserve import LLM

    levels = [int(x) for x in args.running.split(",")]
    rows, results = [], []
    for overlap in (True, False):
        llm = LLM(args.model, max_num_seqs=max(levels), max_num_batched_tokens=max(512, max(levels)),
                  max_model_len=args.prompt_len + HEADROOM,
                  precompile=False, async_scheduling=overlap)
        for n in levels:
            run(llm, n, args.prompt_len, 4)  # warm-up: every bucket these steps meet is compiled
            r = run(llm, n, args.prompt_len, args.steps) | {"async_scheduling": overlap}
            results.append(r)
            rows.append((n, "on" if overlap else "off", r["host_ms"], r["host_cpu_ms"], r["device_wait_ms"],
                         r["wall_ms"], r["device_step_ms"], r["exposed_ms"],
                         f"{r['dispatched_busy']}/{r['steps']}", r["exposed_bound_ms"]))
        del llm
    print(common.table(rows, ("running", "overlap", "host ms/step", "host cpu ms/step", "device wait ms/step",
                                   "wall ms/step", "device step ms", "exposed ms/step", "hidden steps",
                                   "exposed bound ms/step"),
                       "Engine host time per decode step"))
    common.report("host_overhead", argv, model={"model": args.model}, config=vars(args),
                  results={"levels": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
