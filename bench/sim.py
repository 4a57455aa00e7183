"""`jaxserve bench sim`: the real Scheduler and KV manager driven by a cost-model runner.

No model compute: a step takes a + b * prefill_tokens + c * decode_tokens seconds (constants are
printed), sampled tokens are random. Requests arrive on the modelled clock, so queueing, memory
pressure, eviction and preemption behave as in the engine. Runs in seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.workloads import WORKLOADS, WorkItem
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import ADMISSIONS, SchedulerConfig


@dataclass(slots=True)
class CostModel:
    a: float = 4e-3  # fixed per-step overhead (s)
    b: float = 4e-5  # per prefill token (s)
    c: float = 2e-4  # per decode token (s)

    def step_time(self, prefill: int, decode: int) -> float:
        return self.a + self.b * prefill + self.c * decode

    def __str__(self) -> str:
        return (f"step_s = {self.a * 1e3:g} ms + {self.b * 1e6:g} us * prefill_tokens"
                f" + {self.c * 1e6:g} us * decode_tokens")


@dataclass(slots=True)
class SimConfig:
    prefix_cache: str = "radix"
    eviction: str = "lru"
    policy: str = "fcfs"
    prefill_first: bool = False

    @property
    def name(self) -> str:
        first = "prefill-first" if self.prefill_first else "decode-first"
        if self.prefix_cache == "off":
            return f"off {self.policy} {first}"
        return f"{self.prefix_cache} {self.eviction} {self.policy} {first}"


def grid(kind: str) -> list[SimConfig]:
    out = []
    for pf in (False, True):
        out.append(SimConfig("off", "lru", "fcfs", pf))
        if kind == "pair":
            out.append(SimConfig("radix", "lru", "fcfs", pf))
            continue
        for cache in ("hash", "radix"):
            for ev in ("lru", "trunk"):
                for pol in ("fcfs", "lpm") if kind == "full" else ("fcfs",):
                    out.append(SimConfig(cache, ev, pol, pf))
        if kind != "full":
            out.append(SimConfig("radix", "trunk", "lpm", pf))
    return out


def simulate(items: list[WorkItem], cfg: SimConfig, *, num_blocks: int = 512, block_size: int = 16,
             max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int = 4096,
             cost: CostModel | None = None, vocab_size: int = 32000, seed: int = 0,
             admission: str = "optimistic", check_invariants: bool = False) -> dict:
    cost = cost or CostModel()
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        prefix_cache=cfg.prefix_cache, eviction=cfg.eviction, policy=cfg.policy,
        prefill_first=cfg.prefill_first, admission=admission))
    reqs = [Request(f"r{i}", list(it.prompt_token_ids), it.max_tokens, arrival_time=it.arrival_time)
            for i, it in enumerate(items)]
    arrival = {r.request_id: r.arrival_time for r in reqs}
    arrive_step: dict[str, int] = {}
    ttft_s: dict[str, float] = {}
    ttft_steps: dict[str, int] = {}
    e2e_s: dict[str, float] = {}
    t, steps, nxt, rejected = 0.0, 0, 0, 0
    while nxt < len(reqs) or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and reqs[nxt].arrival_time > t:
            t = reqs[nxt].arrival_time  # idle until the next arrival
        while nxt < len(reqs) and reqs[nxt].arrival_time <= t:
            try:
                sched.add_request(reqs[nxt])
                arrive_step[reqs[nxt].request_id] = steps
            except ValueError:
                rejected += 1
            nxt += 1
        out = sched.schedule()
        if check_invariants:
            sched.kv.check_invariants()
        t += cost.step_time(out.num_prefill_tokens, out.num_decode_tokens)
        steps += 1
        sampled = {s.request.request_id: rng.randrange(vocab_size) for s in out.scheduled if s.samples}
        sched.dispatched(out)
        for s in out.scheduled:
            r = s.request
            if s.samples and r.request_id not in ttft_s:
                ttft_s[r.request_id] = t - r.arrival_time
                ttft_steps[r.request_id] = steps - arrive_step[r.request_id]
        for rid, kept in sched.update_from_output(out, sampled).items():
            if kept.finished:  # max_tokens / max_model_len stops
                e2e_s[rid] = t - arrival[rid]
        for r in out.finished:
            e2e_s[r.request_id] = t - r.arrival_time
    if check_invariants:
        sched.kv.check_invariants()
    st = sched.stats()
    assert st["blocks_used"] == 0, "blocks leaked at the end of the run"
    tt_s = np.array(list(ttft_s.values()))
    tt_n = np.array(list(ttft_steps.values()))
    return {
        "config": cfg.name, "prefix_cache": cfg.prefix_cache, "eviction": cfg.eviction,
        "policy": cfg.policy, "prefill_first": cfg.prefill_first,
        "steps": steps, "modelled_time_s": t,
        "ttft_mean_steps": float(tt_n.mean()), "ttft_p99_steps": float(np.percentile(tt_n, 99)),
        "ttft_mean_s": float(tt_s.mean()), "ttft_p99_s": float(np.percentile(tt_s, 99)),
        "e2e_mean_s": float(np.mean(list(e2e_s.values()))),
        "hit_rate": st["hit_rate"], "preemptions": st["preemptions"], "evictions": st["evictions"],
        "computed_tokens": st["num_computed_prompt_tokens"], "requests": len(e2e_s),
        "rejected": rejected,
    }


COLUMNS = [("config", "config", "{}"), ("steps", "steps", "{}"),
           ("ttft_mean_steps", "TTFT mean (steps)", "{:.1f}"), ("ttft_p99_steps", "p99", "{:.0f}"),
           ("ttft_mean_s", "TTFT mean (s)", "{:.3f}"), ("ttft_p99_s", "p99 (s)", "{:.3f}"),
           ("e2e_mean_s", "e2e mean (s)", "{:.3f}"), ("hit_rate", "hit rate", "{:.1%}"),
           ("preemptions", "preempt", "{}"), ("evictions", "evict", "{}")]


def table(rows: list[dict]) -> str:
    cells = [[h for _, h, _ in COLUMNS]] + [[f.format(r[k]) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                               enumerate(zip(row, widths))) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    """One line per (max_num_seqs, config): means over the seeds, and on how many seeds the config
    has fewer preemptions / a lower mean TTFT than cache-off at the same max_num_seqs, seed and
    prefill-first setting."""
    off = {(r["max_num_seqs"], r["seed"], r["prefill_first"]): r for r in rows if r["prefix_cache"] == "off"}
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["max_num_seqs"], r["config"]), []).append(r)
    out = [("| max_num_seqs | config | preempt per seed | preempt mean | fewer than off | TTFT mean (s) "
            "| lower than off |"), "|---|---|---|---|---|---|---|"]
    for (m, name), rs in groups.items():
        n = len(rs)
        base = [off.get((m, r["seed"], r["prefill_first"])) for r in rs]
        if rs[0]["prefix_cache"] == "off" or None in base:
            fewer = lower = "-"
        else:
            fewer = f"{sum(r['preemptions'] < b['preemptions'] for r, b in zip(rs, base))}/{n}"
            lower = f"{sum(r['ttft_mean_s'] < b['ttft_mean_s'] for r, b in zip(rs, base))}/{n}"
        out.append(f"| {m} | {name} | {' '.join(str(r['preemptions']) for r in rs)} "
                   f"| {np.mean([r['preemptions'] for r in rs]):.1f} | {fewer} "
                   f"| {np.mean([r['ttft_mean_s'] for r in rs]):.3f} | {lower} |")
    return "\n".join(out)


def int_list(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers, comma-separated")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="prefill_heavy,decode_heavy,agent_tree,multi_turn_chat,no_sharing",
                   help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int_list, default=None,
                   help="comma-separated seeds to sweep (workload and sampling); default: --seed")
    p.add_argument("--grid", choices=["default", "full", "pair"], default="default",
                   help="full adds lpm to every cache/eviction pair; pair: only off and radix lru fcfs")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int_list, default=[64],
                   help="batch cap; a comma-separated list (e.g. 40,64) runs the grid once per value")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--admission", choices=ADMISSIONS, default="optimistic",
                   help="optimistic: vLLM's (the scheduler's default); conservative: SGLang's new_token_ratio")
    p.add_argument("--cost", default="4e-3,4e-5,2e-4",
                   help="a,b,c of step_s = a + b*prefill_tokens + c*decode_tokens")
    p.add_argument("--summary-only", action="store_true",
                   help="with several seeds or max_num_seqs values, print only the sweep summary")
    p.add_argument("--out", default=None,
                   help="write all rows as JSON here: workloads.NAME is one list of rows, each tagged "
                        "with its max_num_seqs and seed")
    r = p.add_argument_group("replicas (bench/sim_replicas.py): N replicas behind a router, conversation trace")
    r.add_argument("--replicas", type=int_list, default=None,
                   help="comma-separated replica counts (e.g. 1,3): simulate them instead of the workload grid")
    r.add_argument("--routers", default="round_robin,least_load,cache_aware", help="routing policies to compare")
    r.add_argument("--conversations", type=int, default=6)
    r.add_argument("--turns", type=int, default=5)
    r.add_argument("--system-tokens", type=int, default=400)
    r.add_argument("--user-tokens", type=int, default=20)
    r.add_argument("--answer-tokens", type=int, default=16)
    r.add_argument("--shared-system", action="store_true", help="one system prompt for all conversations")
    r.add_argument("--concurrency", type=int, default=None, help="conversations in flight (default: all)")
    r.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns (exponential)")
    args = p.parse_args(argv)
    if args.replicas:
        return replicas_main(args)
    seeds = args.seeds or [args.seed]
    caps = args.max_num_seqs
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for n in names:
        if n not in WORKLOADS:
            p.error(f"unknown workload {n!r}; choose from {', '.join(WORKLOADS)}")
    try:
        cost = CostModel(*(float(x) for x in args.cost.split(",")))
    except (TypeError, ValueError):
        p.error(f"--cost {args.cost!r}: give three numbers a,b,c")
    print(f"cost model: {cost}; {args.num_blocks} blocks x {args.block_size} tokens, "
          f"max_num_seqs={','.join(map(str, caps))}, max_num_batched_tokens={args.max_num_batched_tokens}, "
          f"{args.admission} admission, seed={','.join(map(str, seeds))}")
    result = {"cost_model": {"a": cost.a, "b": cost.b, "c": cost.c, "formula": str(cost)},
              "args": vars(args), "workloads": {}}
    t0 = time.perf_counter()
    sweep = len(seeds) * len(caps) > 1
    for name in names:
        result["workloads"][name] = all_rows = []
        for seed in seeds:
            items = list(WORKLOADS[name](num_requests=args.num_requests, seed=seed))
            for m in caps:
                rows = [simulate(items, c, num_blocks=args.num_blocks, block_size=args.block_size,
                                 max_num_seqs=m, max_num_batched_tokens=args.max_num_batched_tokens,
                                 cost=cost, seed=seed, admission=args.admission) for c in grid(args.grid)]
                for r in rows:
                    r.update(max_num_seqs=m, seed=seed)
                all_rows += rows
                if not (sweep and args.summary_only):
                    tag = f", seed={seed}" if len(seeds) > 1 else ""
                    print(f"\n## {name} ({len(items)} requests), max_num_seqs={m}{tag}\n")
                    print(table(rows))
        if sweep:
            all_rows.sort(key=lambda r: r["max_num_seqs"])  # stable: seeds stay in order
            print(f"\n## {name} sweep: seeds {','.join(map(str, seeds))}, "
                  f"max_num_seqs {','.join(map(str, caps))}\n")
            print(sweep_table(all_rows))
    print(f"\n(simulated in {time.perf_counter() - t0:.1f} s wall)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def replicas_main(args) -> int:
    from bench import sim_replicas as sr

    cost = CostModel(*(float(x) for x in args.cost.split(",")))
    convs = sr.conversation_trace(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                                  args.answer_tokens, args.shared_system, args.seed)
    rows = []
    for n in args.replicas:
        for policy in [x.strip() for x in args.routers.split(",") if x.strip()]:
            rows.append(sr.simulate_replicas(
                convs, n, policy, num_blocks=args.num_blocks, block_size=args.block_size,
                max_num_seqs=args.max_num_seqs[0], max_num_batched_tokens=args.max_num_batched_tokens,
                cost=cost, concurrency=args.concurrency, think_s=args.think_s, seed=args.seed))
    print(f"cost model: {cost}; {args.conversations} conversations x {args.turns} turns, system "
          f"{args.system_tokens} tokens{' (shared)' if args.shared_system else ''}, "
          f"{args.num_blocks} blocks per replica\n")
    print(sr.table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
