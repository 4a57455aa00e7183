"""`jaxserve bench offline`: `LLM.generate` throughput on fixed, seeded workloads.

Workloads (`--workload`, comma-separated, or `all`):
  mixed            the issue-2 workload: 64 prompts of 20-400 tokens, 16-256 new tokens (seed 0),
                   token ids drawn from the vocabulary without special tokens
  prefill_heavy, decode_heavy, agent_tree, multi_turn_chat, no_sharing
                   bench/workloads.py's generators (all requests submitted at once; their arrival
                   times are ignored offline)
Every request runs greedy with ignore_eos, so output lengths are fixed. Each workload gets a fresh
engine (no prefix-cache carry-over between workloads). Before timing: every step bucket is
compiled (reported as compile time) and a short warm-up batch runs; with --no-precompile the whole
workload runs once first (other token ids) as the warm-up instead.

Also measured, once: single-request decode tok/s (one prompt, --single-tokens new tokens, after
warm-up; time between first and last token), next to the memory-bandwidth limit; and, unless
--no-roofline, every throughput as a fraction of this machine's compute roofline (bench/roofline.py).
With --hf, HF transformers runs the first workload's prompts in a subprocess in the same run
(bench/hf_baseline.py) and the ratio jaxserve / HF's better figure is printed.

    jaxserve bench offline [--workload mixed] [--num-prompts 64] [--concurrency 64] [--hf] [--out f.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench import common


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.args import add_engine_args

    p = argparse.ArgumentParser(prog="jaxserve bench offline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="mixed",
                   help=f"comma-separated: {', '.join(common.WORKLOAD_NAMES)}, or all (default mixed)")
    w.add_argument("--num-prompts", type=int, default=64, help="requests per workload (default 64)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    w.add_argument("--prompt-len", default="20,400", help="mixed: min,max prompt tokens (default 20,400)")
    w.add_argument("--output-len", default="16,256", help="mixed: min,max new tokens (default 16,256)")
    w.add_argument("--single-tokens", type=int, default=128,
                   help="single-request decode: new tokens (default 128; 0 skips it)")
    w.add_argument("--single-prompt-len", type=int, default=32, help="single-request prompt tokens (default 32)")
    w.add_argument("--single-repeats", type=int, default=3, help="single-request runs; the median is reported")
    w.add_argument("--concurrency", dest="max_num_seqs", type=int, default=argparse.SUPPRESS,
                   help="sequences per step (= --max-num-seqs, default 64)")
    r = p.add_argument_group("comparisons")
    r.add_argument("--hf", action="store_true", help="also run HF transformers on the first workload (same run)")
    r.add_argument("--hf-batch-size", type=int, default=16, help="HF padded static batch size (default 16)")
    r.add_argument("--hf-max-single", type=int, default=None,
                   help="HF one-at-a-time: only the first N requests (default: all)")
    r.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip measuring the roofline (then no fraction-of-limit figures)")
    r.add_argument("--roofline-json", default=None, help="reuse a `bench roofline --out` file instead of measuring")
    r.add_argument("--step-profile", action="store_true",
                   help="after each timed run, run the workload again (prefix cache reset) with every step "
                        "synced and print time per step bucket (where the time goes)")
    p.add_argument("--out", default=None, help="write JSON here")
    add_engine_args(p, skip=("seed",))  # --seed is the workload's
    return p


def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    return a, b


def engine_kwargs(args) -> dict:
    from jaxserve.config import EngineConfig

    kw = {k: getattr(args, k) for k in EngineConfig.field_names() if hasattr(args, k)}
    kw.pop("model", None)
    kw["precompile"] = False  # done (and timed) here
    return kw


def _stats(llm) -> dict:
    st = llm.engine.get_stats()
    return {k: v for k, v in st.items() if isinstance(v, (int, float))}


def _delta(after: dict, before: dict, keys) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _params(max_tokens: int):
    from jaxserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_workload(llm, items, *, warmup_items=None) -> dict:
    """Time one `generate` over items [(prompt_ids, max_tokens, _)], after an untimed warm-up."""
    if warmup_items:
        llm.generate([p for p, _, _ in warmup_items], [_params(m) for _, m, _ in warmup_items], use_tqdm=False)
    prompts = [p for p, _, _ in items]
    params = [_params(m) for _, m, _ in items]
    before = _stats(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _stats(llm)
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    wanted = sum(m for _, m, _ in items)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
            if o.metrics and o.metrics.first_token_time]
    d = _delta(after, before, ("steps", "computed_tokens", "prefix_cache_queries", "prefix_cache_hits",
                               "prefix_cache_hit_blocks", "preemptions", "evictions", "num_compiles"))
    return {
        "requests": len(items), "prompt_tokens": n_in, "output_tokens": n_out, "wanted_output_tokens": wanted,
        "wall_s": wall, "output_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
        "requests_per_s": len(items) / wall, "steps": d["steps"], "computed_tokens": d["computed_tokens"],
        "prefix_cache_hit_blocks": d["prefix_cache_hit_blocks"], "preemptions": d["preemptions"],
        "evictions": d["evictions"], "compiles_during_run": d["num_compiles"],
        "ttft_s": common.summarize(ttft),
        "mean_context": statistics.fmean(len(p) + m / 2 for p, m, _ in items),
    }


def step_profile(llm, items) -> list[dict]:
    """One more run of items with each step synced: steps, ms/step and real tokens per (T, S) bucket.

    The prefix cache is reset first so the run schedules like the timed one. Syncing each step
    costs little here (the engine waits for every step's tokens anyway)."""
    import jax

    runner = llm.engine.runner
    execute, stats = runner.execute, {}

    def timed(batch, key):
        t0 = time.perf_counter()
        out = jax.block_until_ready(execute(batch, key))
        st = stats.setdefault((key.t, key.s), [0, 0.0, 0])
        st[0] += 1
        st[1] += time.perf_counter() - t0
        st[2] += int(batch.query_start_loc[int(batch.num_seqs[0])])
        return out

    llm.reset_prefix_cache()
    runner.execute = timed
    try:
        llm.generate([p for p, _, _ in items], [_params(m) for _, m, _ in items], use_tqdm=False)
    finally:
        del runner.execute  # back to the class's method
    return [{"tokens": t, "seqs": s, "steps": n, "ms_per_step": 1e3 * sec / n, "total_s": sec,
             "real_tokens": real, "real_tokens_per_step": real / n}
            for (t, s), (n, sec, real) in sorted(stats.items(), key=lambda kv: -kv[1][1])]


def single_decode(llm, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """Decode tok/s of one request alone: (n - 1) tokens over the time from its first to last token."""
    runs = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = llm.generate([prompt], [_params(new_tokens)], use_tqdm=False)[0]
        e2e = time.perf_counter() - t0
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        dt = (m.last_token_time - m.first_token_time) if m and m.last_token_time else None
        runs.append({"tokens": n, "e2e_s": e2e, "ttft_s": m.first_token_time - m.arrival_time,
                     "decode_tok_s": (n - 1) / dt if dt else (n / e2e)})
    return {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "runs": runs,
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs)}


def run_hf(model: str | None, items, single_prompt, args, tmpdir: str) -> dict:
    """HF transformers in a subprocess (own threads and memory), on exactly these prompts."""
    pf = os.path.join(tmpdir, "prompts.json")
    of = os.path.join(tmpdir, "hf.json")
    with open(pf, "w") as f:
        json.dump({"requests": [[p, m] for p, m, _ in items], "single_prompt": single_prompt,
                   "single_tokens": args.single_tokens}, f)
    cmd = [sys.executable, "-m", "bench.hf_baseline", "--prompts-file", pf, "--out", of,
           "--batch-size", str(args.hf_batch_size), "--single-repeats", str(args.single_repeats), "--quiet"]
    if model:
        cmd += ["--model", model]
    if args.hf_max_single is not None:
        cmd += ["--max-single", str(args.hf_max_single)]
    print(f"\n[hf] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=common.REPO, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.hf_baseline failed (exit {proc.returncode})")
    with open(of) as f:
        return json.load(f)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from bench import roofline as rl
    from bench.roofline import config_only
    from jaxserve.model.loader import resolve_model_path

    names = list(common.WORKLOAD_NAMES) if args.workload == "all" else [w for w in args.workload.split(",") if w]
    for n in names:
        if n not in common.WORKLOAD_NAMES:
            raise ValueError(f"Unknown workload {n!r}: choose from {', '.join(common.WORKLOAD_NAMES)} or all.")
    path = resolve_model_path(args.model)
    cfg = config_only(path)
    tok = common.load_tokenizer(args.model)
    special = common.special_token_ids(tok)
    vocab = min(cfg.vocab_size, len(tok))
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    dtype = args.dtype or None

    measured = None
    if args.roofline_json:
        with open(args.roofline_json) as f:
            measured = json.load(f)["results"]["measured"]
    elif args.roofline:
        print("measuring the roofline (matmul GFLOP/s, memory GB/s) ...", flush=True)
        measured = rl.measure(cfg, sorted({1, args.max_num_seqs, 64}))

    from jaxserve import LLM

    results, first_items, single = {}, None, None
    kw = engine_kwargs(args)
    for wi, name in enumerate(names):
        items, clipped = common.workload_items(name, args.num_prompts, args.seed, vocab, special, max_model_len,
                                               _pair(args.prompt_len), _pair(args.output_len))
        first_items = first_items or items
        t0 = time.perf_counter()
        llm = LLM(str(path), **kw)
        load_s = time.perf_counter() - t0
        dtype = dtype or str(llm.engine.runner.dtype)
        kv_dtype = llm.engine.runner.kv_dtype
        compile_s = 0.0
        if args.precompile:
            compile_s = llm.engine.precompile()
            warm, _ = common.workload_items("mixed", 4, args.seed + 1000, vocab, special, max_model_len,
                                            (8, 32), (2, 4))
        else:  # warm-up = the whole workload once, on other token ids (no prefix-cache hits)
            warm, _ = common.workload_items(name, args.num_prompts, args.seed + 1000, vocab, special,
                                            max_model_len, _pair(args.prompt_len), _pair(args.output_len))
        t0 = time.perf_counter()
        llm.generate([p for p, _, _ in warm], [_params(m) for _, m, _ in warm], use_tqdm=False)
        warm_s = time.perf_counter() - t0
        if wi == 0 and args.single_tokens > 0:
            sp, _ = common.workload_items("mixed", 1, args.seed + 2000, vocab, special, max_model_len,
                                          (args.single_prompt_len,) * 2, (args.single_tokens,) * 2)
            single = single_decode(llm, sp[0][0], args.single_tokens, args.single_repeats)
            single["prompt"] = sp[0][0]
        res = run_workload(llm, items)
        res.update(load_s=load_s, compile_s=compile_s, warmup_s=warm_s, clipped_prompts=clipped,
                   kv_capacity_tokens=getattr(llm.engine, "kv_capacity_tokens", None))
        if measured:
            batch = min(args.max_num_seqs, len(items))
            frac = rl.fraction(res["output_tok_s"], cfg, batch, int(res["mean_context"]), measured,
                               kv_dtype_bytes=kv_dtype.itemsize)
            res["roofline"] = {**frac, **rl.work_fraction(res["wall_s"], res["prompt_tokens"],
                                                          res["output_tokens"], cfg, batch,
                                                          int(res["mean_context"]), measured)}
        if args.step_profile:
            res["step_profile"] = step_profile(llm, items)
        results[name] = res
        print(f"[{name}] {res['output_tok_s']:.1f} output tok/s ({res['wall_s']:.1f} s)", flush=True)
        del llm
        gc.collect()

    if single and measured:
        single["roofline"] = rl.ceilings(cfg, 1, args.single_prompt_len + args.single_tokens // 2, measured,
                                         kv_dtype_bytes=kv_dtype.itemsize)
        single["fraction_of_bandwidth_limit"] = single["decode_tok_s"] / single["roofline"]["bandwidth_tok_s"]

    hf = None
    if args.hf:
        with tempfile.TemporaryDirectory(prefix="jaxserve-hf-") as tmp:
            hf = run_hf(args.model and str(path), first_items, single["prompt"] if single else None, args, tmp)
        hf_res = hf["results"]
        best = max(hf_res["single"]["output_tok_s"], hf_res["batched"]["output_tok_s"])
        ours = results[names[0]]["output_tok_s"]
        hf_res["ratio"] = {"workload": names[0], "jaxserve_output_tok_s": ours, "hf_best_output_tok_s": best,
                           "jaxserve_over_hf_best": ours / best}
        if single and hf_res.get("single_decode"):
            hf_res["ratio"]["single_decode_jaxserve_over_hf"] = (
                single["decode_tok_s"] / hf_res["single_decode"]["decode_tok_s"])

    _print(results, single, hf, args, str(kv_dtype))
    common.report("offline", argv, model=common.model_info(path, cfg),
                  config={**{k: v for k, v in vars(args).items()}, "dtype": dtype, "kv_cache_dtype": str(kv_dtype),
                          "workloads": names,
                          "max_model_len": max_model_len},
                  results={"workloads": results, "single_request": single, "roofline_measured": measured,
                           "hf": hf["results"] if hf else None, "hf_machine": hf["machine"] if hf else None},
                  out=args.out)
    return 0


def _print(results: dict, single, hf, args, kv_dtype: str) -> None:
    rows = []
    for name, r in results.items():
        frac = r.get("roofline", {})
        rows.append((name, r["requests"], r["prompt_tokens"], r["output_tokens"], r["wall_s"], r["output_tok_s"],
                     r["total_tok_s"], r["compile_s"], r["prefix_cache_hit_blocks"], r["preemptions"],
                     frac.get("fraction_of_roofline", float("nan")) * 100,
                     frac.get("fraction_of_compute", float("nan")) * 100))
    print(common.table(rows, ("workload", "reqs", "prompt tok", "output tok", "wall s", "out tok/s", "total tok/s",
                              "compile s", "hit blocks", "preempt", "% roofline", "% compute"),
                       f"jaxserve offline (max_num_seqs={args.max_num_seqs}, "
                       f"max_num_batched_tokens={args.max_num_batched_tokens}, KV {kv_dtype})"))
    print("  % roofline: output tok/s / min(compute, bandwidth) ceiling at that batch and mean context;"
          " % compute: ideal FLOP time / wall time (prompt + output tokens)")
    for name, r in results.items():
        if "step_profile" in r:
            rows = [(f"({b['tokens']}, {b['seqs']})", b["steps"], b["ms_per_step"], b["total_s"],
                     b["real_tokens_per_step"]) for b in r["step_profile"]]
            print(common.table(rows, ("bucket (tokens, seqs)", "steps", "ms/step", "total s", "real tokens/step"),
                               f"[{name}] time per step bucket (a second run, each step synced)"))
    if single:
        rl = single.get("roofline", {})
        print(common.kv_table([
            ("prompt tokens / new tokens", f"{single['prompt_tokens']} / {single['new_tokens']}"),
            ("decode tok/s (median)", single["decode_tok_s"]),
            ("TTFT s (median)", single["ttft_s"]),
            ("bandwidth limit tok/s (weights + KV per token)", rl.get("bandwidth_tok_s")),
            ("fraction of bandwidth limit", single.get("fraction_of_bandwidth_limit")),
        ], "Single-request decode (jaxserve)"))
    if hf:
        h = hf["results"]
        rows = [("jaxserve (continuous batching)", results[h["ratio"]["workload"]]["output_tok_s"],
                 results[h["ratio"]["workload"]]["wall_s"])]
        rows.append((f"HF one at a time ({h['single']['requests']} reqs)", h["single"]["output_tok_s"],
                     h["single"]["wall_s"]))
        rows.append((f"HF padded batches of {h['batched']['batch_size']}", h["batched"]["output_tok_s"],
                     h["batched"]["wall_s"]))
        print(common.table(rows, ("system", "useful out tok/s", "wall s"),
                           "jaxserve vs HF transformers (torch float32)"))
        print(f"  jaxserve / HF best: {h['ratio']['jaxserve_over_hf_best']:.2f}x")
        if "single_decode_jaxserve_over_hf" in h["ratio"]:
            print(f"  single-request decode: jaxserve {single['decode_tok_s']:.1f} tok/s, "
                  f"HF {h['single_decode']['decode_tok_s']:.1f} tok/s "
                  f"({h['ratio']['single_decode_jaxserve_over_hf']:.2f}x)")


if __name__ == "__main__":
    raise SystemExit(main())
