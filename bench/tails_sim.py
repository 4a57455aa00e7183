"""`jaxserve bench tails_sim`: `vllm bench serve`'s closed loop (bench/vllm_tails.py's load) run
through the real Scheduler with one step in flight, as the engine runs it, on a modelled clock.

No model compute: a step takes a + b * prefill_tokens + c * decode_rows seconds (defaults fitted to
a step trace of the default model in bfloat16 on a 2-core Xeon: decode-only steps of 32 rows 38 ms,
512-token chunk steps 124-135 ms). A request's tokens land when the step after it is dispatched;
TTFT and the gaps between a stream's tokens (ITL) are read off that clock. Shows what a scheduling
policy does to the tails in seconds, without the load or run-to-run spread of a real server (the
real figures: `jaxserve bench vllm_tails`).
"""

from __future__ import annotations

import argparse
import random
import sys

from bench import common
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import SchedulerConfig


def prompts(dataset: str, n: int, rng: random.Random, vocab: int = 1000) -> list[list[int]]:
    """random: 200 tokens each; prefix: one of 8 shared 256-token prefixes + 64 tokens (vllm_tails)."""
    if dataset == "random":
        return [[rng.randrange(vocab) for _ in range(200)] for _ in range(n)]
    shared = [[rng.randrange(vocab) for _ in range(256)] for _ in range(8)]
    return [shared[rng.randrange(8)] + [rng.randrange(vocab) for _ in range(64)] for _ in range(n)]


def simulate(dataset: str, *, burst_prefill_first: bool, num_prompts: int, concurrency: int, output_len: int,
             budget: int, cost: tuple[float, float, float], seed: int) -> dict:
    a, b, c = cost
    rng = random.Random(seed)
    todo = prompts(dataset, num_prompts, rng)
    sched = Scheduler(SchedulerConfig(num_blocks=8192, block_size=16, max_num_seqs=max(64, concurrency),
                                      max_num_batched_tokens=budget, max_model_len=4096,
                                      burst_prefill_first=burst_prefill_first))
    now, sent, last, ttft, gaps = 0.0, {}, {}, [], []

    def send() -> None:
        r = Request(f"r{len(sent)}", todo[len(sent)], output_len)
        sent[r.request_id] = now
        sched.add_request(r)

    while len(sent) < min(concurrency, num_prompts):
        send()
    done, inflight = 0, None
    while done < num_prompts:
        out = sched.schedule()
        sched.dispatched(out)
        if inflight is not None:  # the step before lands while this one runs
            step, end = inflight
            sampled = {s.request.request_id: 1 for s in step.scheduled if s.samples and not s.request.is_finished}
            for rid, kept in sched.update_from_output(step, sampled).items():
                (gaps if rid in last else ttft).append(end - last.get(rid, sent[rid]))
                last[rid] = end
                if kept.finished:
                    done += 1
                    if len(sent) < num_prompts:
                        send()
        if out.scheduled:
            now += a + b * out.num_prefill_tokens + c * out.num_decode_tokens
        inflight = (out, now) if out.scheduled else None
    return {"dataset": dataset, "burst_prefill_first": burst_prefill_first,
            "out_tok_s": num_prompts * output_len / now, "ttft_p50_s": common.percentile(ttft, 50),
            "ttft_p99_s": common.percentile(ttft, 99), "itl_p50_ms": 1e3 * common.percentile(gaps, 50),
            "itl_p99_ms": 1e3 * common.percentile(gaps, 99), "itl_max_ms": 1e3 * max(gaps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench tails_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="random,prefix")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cost", default="0.030,0.000195,0.00025",
                   help="a,b,c: seconds a step, a prefill token, a decode row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cost = tuple(float(x) for x in args.cost.split(","))
    rows = [simulate(d, burst_prefill_first=bpf, num_prompts=args.num_prompts, concurrency=args.concurrency,
                     output_len=args.output_len, budget=args.max_num_batched_tokens, cost=cost, seed=args.seed)
            for d in args.datasets.split(",") for bpf in (False, True)]
    print(common.table([[r["dataset"], "on" if r["burst_prefill_first"] else "off", common.fmt(r["out_tok_s"]),
                         common.fmt(r["ttft_p50_s"], 2), common.fmt(r["ttft_p99_s"], 2), common.fmt(r["itl_p50_ms"]),
                         common.fmt(r["itl_p99_ms"]), common.fmt(r["itl_max_ms"])] for r in rows],
                       ["dataset", "burst prefill first", "out tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
                        "ITL p99 ms", "ITL max ms"],
                       title=f"modelled clock: step = {cost[0]} s + {cost[1]} s x prefill tokens + "
                             f"{cost[2]} s x decode rows"))
    common.report("tails_sim", argv, model={}, config=vars(args), results={"rows": rows}, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
