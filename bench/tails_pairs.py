"""`jaxserve bench tails_pairs`: many `vllm_tails` pairs read as one paired comparison.

One `jaxserve bench vllm_tails` run with two engines is a pair: the same load, one engine after the
other, minutes apart. On a VM whose pace swings ~10-15% between minutes (bench/RESULTS.md), one pair
says little about a tail of ~4 s; many pairs, each compared within itself, do. For each dataset and
figure this reads the pairs' JSON files and prints in how many pairs engine A was at least as good
as engine B (lower latency, higher throughput), the median of A - B, and the one-sided sign test's
p-value (the chance of that many wins or more if each pair were a coin toss), then the pairs one by
one with each run's vCPU placement (bench/core_link.py, before/after the run: n near, f far).

    jaxserve bench tails_pairs bench/out/vllm_tails_*.json [--engines jaxserve,vllm] [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from bench import common, vllm_tails

# (figure, key in a run's record, higher is better)
FIGURES = (("P99 TTFT ms", "p99_ttft_ms", False), ("P99 ITL ms", "p99_itl_ms", False),
           ("out tok/s", "output_throughput", True), ("goodput req/s", "request_goodput", True))


def sign_test_p(wins: int, n: int) -> float:
    """One-sided sign test: P(at least `wins` of n fair coin tosses)."""
    return sum(math.comb(n, i) for i in range(wins, n + 1)) / 2 ** n if n else math.nan


def load_pairs(paths: list[str], a: str, b: str) -> list[dict]:
    """{"name", "runs": {(engine, dataset): run}} for each file holding runs of both engines."""
    pairs = []
    for path in paths:
        runs = json.loads(Path(path).read_text())["results"]["runs"]
        by = {(r["engine"], r["dataset"]): r for r in runs if not r.get("failed")}
        if any(e == a for e, _ in by) and any(e == b for e, _ in by):
            pairs.append({"name": Path(path).stem, "runs": by})
    return pairs


def summarize(pairs: list[dict], a: str, b: str, datasets: list[str]) -> list[dict]:
    """Per dataset and figure: pairs, A's wins (at least as good as B), median A - B, sign test p."""
    out = []
    for ds in datasets:
        for name, key, higher in FIGURES:
            diffs = [p["runs"][(a, ds)][key] - p["runs"][(b, ds)][key]
                     for p in pairs if (a, ds) in p["runs"] and (b, ds) in p["runs"]]
            wins = sum((d >= 0) if higher else (d <= 0) for d in diffs)
            out.append({"dataset": ds, "figure": name, "pairs": len(diffs), "wins": wins,
                        "median_diff": statistics.median(diffs) if diffs else math.nan,
                        "sign_test_p": sign_test_p(wins, len(diffs))})
    return out


def short_placement(run: dict) -> str:
    """"nf": near before the run, far after it (vllm_tails.run_placement's initials)."""
    return "".join(p[:1] for p in vllm_tails.run_placement(run))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench tails_pairs", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("files", nargs="+", help="`jaxserve bench vllm_tails --out` JSON files, one pair each")
    p.add_argument("--engines", default="jaxserve,vllm", help="A,B: the engines compared (A - B)")
    p.add_argument("--datasets", default="random,prefix")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)
    a, b = args.engines.split(",")
    datasets = args.datasets.split(",")
    pairs = load_pairs(args.files, a, b)
    if not pairs:
        raise SystemExit(f"none of the {len(args.files)} files holds runs of both {a} and {b}")
    summary = summarize(pairs, a, b, datasets)
    print(common.table([(s["dataset"], s["figure"], s["pairs"], s["wins"], s["median_diff"], s["sign_test_p"])
                        for s in summary],
                       ("dataset", "figure", "pairs", f"{a} at least as good", f"median {a} - {b}", "sign test p"),
                       f"{len(pairs)} pairs, {a} against {b}"))
    rows = []
    for pr in pairs:
        for ds in datasets:
            ra, rb = pr["runs"].get((a, ds)), pr["runs"].get((b, ds))
            if ra and rb:
                rows.append((pr["name"], ds, ra["p99_ttft_ms"], rb["p99_ttft_ms"], ra["p99_itl_ms"],
                             rb["p99_itl_ms"], ra["output_throughput"], rb["output_throughput"], short_placement(ra),
                             short_placement(rb)))
    print(common.table(rows, ("pair", "dataset", f"{a} TTFT p99 ms", f"{b} TTFT p99 ms", f"{a} ITL p99 ms",
                              f"{b} ITL p99 ms", f"{a} tok/s", f"{b} tok/s", f"{a} vCPUs", f"{b} vCPUs"),
                       "each pair"))
    common.report("tails_pairs", argv, model={}, config=vars(args),
                  results={"summary": summary, "pairs": [list(r) for r in rows]}, out=args.out,
                  jax_devices=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
