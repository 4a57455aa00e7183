"""Where the inter-token latency spikes come from: a table of an engine step trace.

    JAXSERVE_STEP_TRACE=/tmp/steps.jsonl jaxserve serve ...   # then run a load, e.g. `jaxserve bench serve`
    jaxserve bench step_trace /tmp/steps.jsonl [--out bench/out/step_trace.json]

Reads the JSON lines `jaxserve/step_trace.py` writes (one per step the engine read back) and
groups the steps by how many prefill tokens they carried next to their decode rows. `gap` is the
time from the step before being read to this one being read: while the engine is busy, the
inter-token latency every stream in that step sees. Per group: steps, mean / p50 / p99 gap, the
decode rows that waited through those gaps (how much of the ITL distribution the group makes), and
its host time. Then the slowest steps one by one (compiles, GC pauses and host time named), and the
totals of GC time (while busy, and before the first step after start-up or idle: start-up's own
`gc.collect()` shows there) and of steps on a bucket seen for the first time.
"""

from __future__ import annotations

import argparse
import json

GROUPS = ((0, 0), (1, 32), (33, 64), (65, 128), (129, 256), (257, 512), (513, 1 << 30))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(rows: list[dict], top: int = 10) -> dict:
    timed = [r for r in rows if r["gap_s"] is not None and r["decode"] > 0]
    total_rows = sum(r["decode"] for r in timed) or 1
    groups = []
    for lo, hi in GROUPS:
        g = [r for r in timed if lo <= r["prefill"] <= hi]
        if not g:
            continue
        gaps = [r["gap_s"] for r in g]
        groups.append(dict(
            prefill=f"{lo}" if lo == hi else f"{lo}-{hi if hi < 1 << 30 else 'more'}", steps=len(g),
            mean_ms=1e3 * sum(gaps) / len(g), p50_ms=1e3 * pct(gaps, 50), p99_ms=1e3 * pct(gaps, 99),
            decode_rows=sum(r["decode"] for r in g), share_of_itls=sum(r["decode"] for r in g) / total_rows,
            host_ms=1e3 * sum(r["host_s"] for r in g) / len(g)))
    # the ITL distribution as the streams see it: each step's gap once per decode row in it
    weighted = sorted(x for r in timed for x in [r["gap_s"]] * r["decode"])
    slow = sorted(timed, key=lambda r: -r["gap_s"])[:top]
    return dict(
        steps=len(rows), timed_steps=len(timed), itl_p50_ms=1e3 * pct(weighted, 50),
        itl_p99_ms=1e3 * pct(weighted, 99), gc_s=sum(r["gc_s"] for r in rows if r["gap_s"] is not None),
        gc_before_s=sum(r["gc_s"] for r in rows if r["gap_s"] is None),
        new_buckets=sum(bool(r["new_bucket"]) for r in rows), groups=groups, slowest=slow)


def show(s: dict) -> None:
    print(f"{s['steps']} steps ({s['timed_steps']} with decode rows while busy); ITL from the trace: "
          f"p50 {s['itl_p50_ms']:.1f} ms, p99 {s['itl_p99_ms']:.1f} ms; GC {s['gc_s'] * 1e3:.0f} ms while busy "
          f"({s['gc_before_s'] * 1e3:.0f} ms before first steps after idle, start-up included); "
          f"{s['new_buckets']} steps on a bucket seen for the first time")
    print(f"{'prefill tokens':>14} {'steps':>6} {'mean ms':>8} {'p50 ms':>7} {'p99 ms':>7} {'decode rows':>11} "
          f"{'ITL share':>9} {'host ms':>7}")
    for g in s["groups"]:
        print(f"{g['prefill']:>14} {g['steps']:>6} {g['mean_ms']:>8.1f} {g['p50_ms']:>7.1f} {g['p99_ms']:>7.1f} "
              f"{g['decode_rows']:>11} {100 * g['share_of_itls']:>8.1f}% {g['host_ms']:>7.2f}")
    print("slowest steps:")
    print(f"{'step':>6} {'gap ms':>7} {'T':>5} {'S':>4} {'prefill':>7} {'decode':>6} {'cap':>5} {'host ms':>7} "
          f"{'gc ms':>6} new-bucket")
    for r in s["slowest"]:
        print(f"{r['step']:>6} {1e3 * r['gap_s']:>7.1f} {r['t']!s:>5} {r['s']!s:>4} {r['prefill']:>7} {r['decode']:>6} "
              f"{r['prefill_cap']!s:>5} {1e3 * r['host_s']:>7.2f} {1e3 * r['gc_s']:>6.1f} {r['new_bucket']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench step_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="the JSONL file JAXSERVE_STEP_TRACE named")
    p.add_argument("--top", type=int, default=10, help="slowest steps to list")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    s = summarize(load(args.trace), args.top)
    show(s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
