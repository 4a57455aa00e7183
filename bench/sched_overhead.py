"""Host overhead of one engine step's bookkeeping: schedule() + update_from_output() (block
allocation, prefix-cache commits, sampled-token appends) with N running requests decoding.

Usage: python -m bench.sched_overhead [--running 256] [--steps 2000] [--prefix-cache radix]
Target: < 1 ms per step with 256 running requests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import SchedulerConfig


def measure(num_running: int = 256, steps: int = 2000, prefix_cache: str = "radix",
            eviction: str = "lru", policy: str = "fcfs", admission: str = "optimistic",
            seed: int = 0) -> dict:
    rng = random.Random(seed)
    bs = 16
    sched = Scheduler(SchedulerConfig(
        num_blocks=num_running * 64 + 1, block_size=bs, max_num_seqs=num_running,
        max_num_batched_tokens=max(2048, num_running), max_model_len=4096,
        prefix_cache=prefix_cache, eviction=eviction, policy=policy, admission=admission))
    system = [rng.randrange(32000) for _ in range(128)]
    n = 0

    def new() -> None:
        nonlocal n
        prompt = system + [rng.randrange(32000) for _ in range(rng.randint(16, 200))]
        sched.add_request(Request(f"r{n}", prompt, rng.randint(64, 512)))
        n += 1

    for _ in range(num_running):
        new()
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or sched.num_waiting:
        out = sched.schedule()  # warm-up: prefill everyone
        sched.dispatched(out)
        sched.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.dispatched(out)
        landed = sched.update_from_output(out, {s.request.request_id: rng.randrange(32000)
                                                for s in out.scheduled if s.samples})
        times.append(time.perf_counter() - t0)
        # keep the population at N: replace finished ones (not timed)
        for _ in (k for k in landed.values() if k.finished):
            new()
    times.sort()
    return {"running": num_running, "steps": steps, "prefix_cache": prefix_cache,
            "eviction": eviction, "policy": policy, "admission": admission,
            "mean_us": 1e6 * sum(times) / len(times), "p50_us": 1e6 * times[len(times) // 2],
            "p99_us": 1e6 * times[int(len(times) * 0.99)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sched_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    configs = [("off", "lru", "fcfs", "optimistic"), ("hash", "lru", "fcfs", "optimistic"),
               ("radix", "lru", "fcfs", "optimistic"), ("radix", "trunk", "lpm", "optimistic"),
               ("radix", "lru", "fcfs", "conservative")]
    rows = [measure(args.running, args.steps, *c) for c in configs]
    print(f"schedule() + update_from_output() with {args.running} running requests decoding")
    print("| cache | eviction | policy | admission | mean (us) | p50 (us) | p99 (us) |")
    print("|-------|----------|--------|-----------|-----------|----------|----------|")
    for r in rows:
        print(f"| {r['prefix_cache']} | {r['eviction']} | {r['policy']} | {r['admission']} | "
              f"{r['mean_us']:.0f} | {r['p50_us']:.0f} | {r['p99_us']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
