"""`jaxserve bench kv_pages`: engine steps with the CPU KV cache on 2 MiB pages and on 4 KiB pages.

    jaxserve bench kv_pages [--model M] [--rounds 3] [--out bench/out/kv_pages.json]

Each run is a fresh process over the model (the default model unless --model), with
`JAXSERVE_KV_HUGE_PAGES` on or off (jaxserve/runtime/huge_pages.py), the two alternating `--rounds`
times. A run first churns the cache as a server's traffic does (four rounds of 48 prompts of 50-400
tokens and 16-128 tokens out: afterwards the free list hands out blocks from anywhere in the cache),
then times three rounds of 32 prompts of 250-300 tokens and 96 out, greedy, through `LLM` with a
step trace (jaxserve/step_trace.py). Per run: the median and spread of the 32-row decode steps'
gaps, the median of the 512-token prefill steps, and the rounds' wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench import common

MODES = {"2 MiB": "1", "4 KiB": "0"}


def child(model: str | None, trace: str) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams

    llm = LLM(model) if model else LLM()
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size

    def prompts(n, lo, hi):
        return [{"prompt_token_ids": rng.integers(100, vocab - 100, int(rng.integers(lo, hi))).tolist()}
                for _ in range(n)]

    for _ in range(4):
        llm.generate(prompts(48, 50, 400), SamplingParams(max_tokens=int(rng.integers(16, 128)), temperature=0,
                                                          ignore_eos=True), use_tqdm=False)
    skip = sum(1 for _ in open(trace))
    t0 = time.perf_counter()
    for _ in range(3):
        llm.generate(prompts(32, 250, 300), SamplingParams(max_tokens=96, temperature=0, ignore_eos=True),
                     use_tqdm=False)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(trace)][skip:]
    decode = [1e3 * r["gap_s"] for r in rows if r["gap_s"] and not r["prefill"] and r["decode"] == 32]
    prefill = [1e3 * r["gap_s"] for r in rows if r["gap_s"] and r["prefill"] >= 500]
    huge_kib = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHuge"))
    return {"anon_huge_mib": huge_kib >> 10, "wall_s": wall,
            "decode32": common.summarize(decode, (10, 50, 90)), "decode32_steps": len(decode),
            "prefill512_median_ms": statistics.median(prefill) if prefill else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench kv_pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: the default model)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two page sizes")
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a run's trace path
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.child)))
        return 0
    runs = []
    for rnd in range(args.rounds):
        for mode, env in MODES.items():
            with tempfile.TemporaryDirectory() as tmp:
                trace = os.path.join(tmp, "steps.jsonl")
                cmd = [sys.executable, "-m", "bench.kv_pages", "--child", trace]
                if args.model:
                    cmd += ["--model", args.model]
                env_vars = {**os.environ, "JAXSERVE_KV_HUGE_PAGES": env, "JAXSERVE_STEP_TRACE": trace}
                out = subprocess.run(cmd, env=env_vars, check=True, capture_output=True, text=True).stdout
                runs.append({"round": rnd, "pages": mode, **json.loads(out.strip().splitlines()[-1])})
                r = runs[-1]
                print(f"round {rnd} {mode}: decode-32 median {r['decode32']['median']:.1f} ms, "
                      f"prefill-512 {r['prefill512_median_ms']:.1f} ms, AnonHugePages {r['anon_huge_mib']} MiB",
                      flush=True)
    rows = [(r["round"], r["pages"], r["anon_huge_mib"], r["decode32_steps"], r["decode32"]["p10"],
             r["decode32"]["median"], r["decode32"]["p90"], r["prefill512_median_ms"], r["wall_s"]) for r in runs]
    print(common.table(rows, ("round", "KV pages", "AnonHugePages MiB", "decode-32 steps", "p10 ms", "median ms",
                              "p90 ms", "prefill-512 median ms", "timed rounds s"),
                       "steps after churn, the page sizes alternating"))
    common.report("kv_pages", argv, model={"model": args.model or "default"}, config=vars(args),
                  results={"runs": runs}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
