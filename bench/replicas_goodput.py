"""`python -m bench.replicas_goodput`: goodput at an SLO on the conversation trace, 1 replica
against N replicas behind SMG (round_robin, then cache_aware), in one run.

Starts `jaxserve serve --data-parallel-size N --router none` (bench/replicas.py's launcher), puts
SMG in front with each policy in turn (prefix caches reset between policies), and runs `bench serve
--dataset conversations` (conversations concurrently, each one's turns in order, TTFT/TPOT/E2E and
goodput) against SMG. Prints one table and writes JSON (--out).

    python -m bench.replicas_goodput --model M --replicas 1,3 --slo ttft:500ms tpot:100ms --out g.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from bench import common
from bench import replicas as fleet
from bench import serve


def measure(model_args: list[str], n: int, policies: list[str], trace_args: list[str], log_dir: str) -> list[dict]:
    rows = []
    with fleet.running_fleet(model_args, n, f"{log_dir}/fleet-{n}.log") as (_, urls, startup_s):
        for policy in policies if n > 1 else policies[:1]:
            fleet.reset_prefix_caches(urls)
            hits0 = sum(fleet.counters(u)["vllm:prefix_cache_hits"] for u in urls)  # counters are cumulative
            out = f"{log_dir}/serve-{n}-{policy}.json"
            with fleet.routed(urls, policy) as url:
                serve.main(["--base-url", url, *trace_args, "--out", out])
            s = json.loads(Path(out).read_text())["results"]["levels"][0]["summary"]
            hits = sum(fleet.counters(u)["vllm:prefix_cache_hits"] for u in urls) - hits0
            rows.append({"replicas": n, "policy": policy if n > 1 else "(one replica)", "startup_s": startup_s,
                         "hit_tokens": hits, **{k: s[k] for k in ("completed", "failed", "request_throughput",
                                                                  "goodput_req_s", "goodput_fraction")},
                         "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                         "tpot_p50_ms": s["tpot_ms"]["median"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas_goodput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--server-args", default="", help="extra `jaxserve serve` arguments for every replica")
    p.add_argument("--replicas", default="1,3", help="fleet sizes, comma-separated")
    p.add_argument("--policies", default="round_robin,cache_aware")
    p.add_argument("--slo", nargs="*", default=["ttft:500ms", "tpot:100ms"])
    p.add_argument("--trace-args", default="--num-conversations 12 --turns 5 --concurrency 12 --max-tokens 16",
                   help="`bench serve` dataset/load arguments (the conversations trace is always used)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model_args = ["--model", args.model, *shlex.split(args.server_args)]
    trace = ["--dataset", "conversations", "--model", args.model, *shlex.split(args.trace_args), "--slo", *args.slo]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.replicas.split(",")):
            rows += measure(model_args, n, args.policies.split(","), trace, tmp)
    cols = ("replicas", "policy", "completed", "failed", "request_throughput", "goodput_req_s", "goodput_fraction",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "hit_tokens")
    print(common.table([tuple(r[c] for c in cols) for r in rows], cols, f"goodput at {' '.join(args.slo)}"))
    common.report("replicas_goodput", argv, model={"model": args.model},
                  config={**vars(args)}, results={"rows": rows}, out=args.out, jax_devices=False)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
