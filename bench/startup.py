"""`jaxserve bench startup`: where start-up time goes, phase by phase, from a cold and a warm cache.

Each run is a fresh subprocess. "cold" points JAXSERVE_CACHE_DIR (the native kernel library and the
XLA compilation cache) at an empty directory; "warm" runs again on the directory the cold run
filled. The model file itself comes from the OS page cache after the first run in both cases (not
controlled: that needs root to drop caches).

  --mode generate  `jaxserve generate "What is the capital of France?"` -> its first streamed token
  --mode serve     `jaxserve serve` -> /health ok -> one streamed /v1/completions token over HTTP
  --mode llm       python -c: import jaxserve -> LLM(model) -> precompile every step bucket -> one token

The child writes its phase marks (jaxserve/startup_trace.py: cli, imports, weight format, weights
read, tokenizer, backend (native kernels), weights placed, kv cache, engine, one per compiled
bucket, precompile, app, listening, first token); the table gives each phase's end (seconds since
spawn) and its own seconds, cold and warm (median of the warm runs), plus the buckets compiled
before the first token or /health and their summed compile seconds.

    jaxserve bench startup [--mode generate|serve|llm] [--model PATH] [--repeats 2] [--engine-args "..."]
                           [--out bench/out/startup_generate.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from bench import common
from jaxserve import paths, startup_trace

CHILD = r"""
import json, os, sys, time
t_start = time.time()
from jaxserve import LLM
from jaxserve.sampling_params import SamplingParams
t_import = time.time()
model, kw, precompile = sys.argv[1] or None, json.loads(sys.argv[2]), sys.argv[3] == "1"
llm = LLM(model, precompile=False, **kw)
t_load = time.time()
if precompile:
    llm.engine.precompile()
t_compile = time.time()
ids = llm.get_tokenizer().encode("The capital of France is")
out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
t_first = time.time()
print("RESULT " + json.dumps(dict(t_start=t_start, t_import=t_import, t_load=t_load, t_compile=t_compile,
                                  t_first=t_first, compiles=llm.engine.runner.num_compiles)), flush=True)
"""


PROMPT = "What is the capital of France?"


def _cache_files(path: str) -> int:
    return sum(len(f) for _, _, f in os.walk(path)) if os.path.isdir(path) else 0


def _env(cache_dir: str, trace: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_COMPILATION_CACHE"}
    return {**env, "JAXSERVE_CACHE_DIR": cache_dir, "TF_CPP_MIN_LOG_LEVEL": "2", startup_trace.ENV: trace}


def phases(marks: list[dict], t_spawn: float) -> dict:
    """{"phases": [(name, end s since spawn, own s)], "compiles": n, "compile_s": summed, "buckets": [...]}
    from a child's marks; compile marks are events (their own seconds), not phases."""
    out, prev, compiles = [], 0.0, []
    for m in marks:
        if m["phase"] == "compile":
            compiles.append({"bucket": m.get("bucket"), "s": m.get("s"), "at_s": m["t"] - t_spawn})
            continue
        at = m["t"] - t_spawn
        out.append((m["phase"], at, at - prev))
        prev = at
    return {"phases": out, "compiles": len(compiles), "compile_s": sum(c["s"] or 0.0 for c in compiles),
            "buckets": compiles}


def _trace_file() -> str:
    fd, path = tempfile.mkstemp(prefix="jaxserve-startup-", suffix=".jsonl")
    os.close(fd)
    return path


def run_llm(model: str | None, engine_kw: dict, precompile: bool, cache_dir: str) -> dict:
    trace = _trace_file()
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, model or "", json.dumps(engine_kw), "1" if precompile else "0"],
                          capture_output=True, text=True, env=_env(cache_dir, trace), cwd=common.REPO, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"start-up run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(line[7:])
    marks = startup_trace.read(trace) + [{"phase": "first token", "t": r["t_first"]}]
    os.unlink(trace)
    return {"total_s": r["t_first"] - t_spawn, **phases(marks, t_spawn), "cache_files_after": _cache_files(cache_dir)}


def run_generate(model: str | None, extra_args: str, cache_dir: str) -> dict:
    trace = _trace_file()
    cmd = [sys.executable, "-m", "jaxserve.cli", "generate", PROMPT, "--stream"] + (
        ["--model", model] if model else []) + shlex.split(extra_args)
    t_spawn = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(cache_dir, trace), cwd=common.REPO,
                          check=False)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    marks = startup_trace.read(trace)
    os.unlink(trace)
    first = next((m["t"] for m in marks if m["phase"] == "first token"), t_exit)
    return {"total_s": first - t_spawn, "exit_s": t_exit - t_spawn, **phases(marks, t_spawn),
            "answer": proc.stdout.strip()[:200], "cache_files_after": _cache_files(cache_dir),
            "command": shlex.join(cmd)}


def run_serve(model: str | None, server_args: str, cache_dir: str, timeout: float) -> dict:
    import httpx

    from bench.launch import free_port

    port = free_port()
    trace = _trace_file()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"] + (["--model", model] if model else []) + shlex.split(server_args)
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finally
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(cache_dir, trace), cwd=common.REPO,
                            start_new_session=True)
    try:

        def tail() -> str:
            log.seek(0)
            return log.read().decode()[-2000:]

        common.wait_healthy(proc, url, timeout - (time.time() - t0), tail)
        t_health = time.time()
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": name, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    break
        t_first = time.time()
        before_health = [m for m in startup_trace.read(trace) if m["t"] <= t_health]
    finally:
        common.stop_server(proc)
        log.close()
    marks = before_health + [{"phase": "healthy", "t": t_health}, {"phase": "first token", "t": t_first}]
    os.unlink(trace)
    return {"total_s": t_first - t0, "healthy_s": t_health - t0, "first_token_after_healthy_s": t_first - t_health,
            **phases(marks, t0), "cache_files_after": _cache_files(cache_dir), "command": shlex.join(cmd)}


def phase_table(cold: dict, warm: list[dict]) -> list[tuple]:
    """Rows (phase, cold end s, cold own s, warm end s, warm own s): warm = the median run's."""
    med = sorted(warm, key=lambda r: r["total_s"])[len(warm) // 2] if warm else None
    names = [n for n, _, _ in cold["phases"]]
    if med:
        names += [n for n, _, _ in med["phases"] if n not in names]
    c = {n: (at, own) for n, at, own in cold["phases"]}
    w = {n: (at, own) for n, at, own in med["phases"]} if med else {}
    rows = [(n, *c.get(n, (None, None)), *w.get(n, (None, None))) for n in names]
    rows.append((f"(buckets compiled: {cold['compiles']} cold, {med['compiles'] if med else '-'} warm)",
                 None, cold["compile_s"], None, med["compile_s"] if med else None))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench startup", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=("generate", "serve", "llm"), default="generate")
    p.add_argument("--model", "-m", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--repeats", type=int, default=2, help="warm runs (default 2); the median is reported")
    p.add_argument("--engine-args", default="",
                   help='llm mode: EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 64}\'; '
                   'generate / serve mode: extra command-line arguments')
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="llm mode: compile on first use instead of every bucket up front")
    p.add_argument("--cache-dir", default=None, help="JAXSERVE_CACHE_DIR to fill (empty; default: a new temp dir)")
    p.add_argument("--warm-kernels", action="store_true",
                   help="cold runs reuse this machine's built native kernels (only XLA and step caches are cold)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    engine_kw = json.loads(args.engine_args) if (args.mode == "llm" and args.engine_args) else {}
    tmp = None
    if args.cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="jaxserve-xla-cache-")
        cache = tmp.name
    else:
        cache = args.cache_dir
        if _cache_files(cache):
            raise ValueError(f"--cache-dir {cache} is not empty: a cold run needs an empty directory.")

    kernels = paths.cache_dir() / "kernels"
    if args.warm_kernels and kernels.is_dir() and not os.path.exists(os.path.join(cache, "kernels")):
        os.symlink(kernels, os.path.join(cache, "kernels"))

    def once() -> dict:
        if args.mode == "llm":
            return run_llm(args.model, engine_kw, args.precompile, cache)
        if args.mode == "generate":
            return run_generate(args.model, args.engine_args, cache)
        return run_serve(args.model, args.engine_args, cache, args.timeout)

    try:
        print("cold run (empty compilation cache) ...", flush=True)
        cold = once()
        warm = []
        for i in range(args.repeats):
            print(f"warm run {i + 1}/{args.repeats} ...", flush=True)
            warm.append(once())
    finally:
        if tmp is not None:
            tmp.cleanup()
    med = sorted(warm, key=lambda r: r["total_s"])[len(warm) // 2] if warm else {}
    print(common.table(phase_table(cold, warm), ("phase (ends at s since spawn; own s)", "cold at", "cold own",
                                                 "warm at", "warm own"),
                       f"Start-up to first token ({args.mode} mode), cold vs warm cache (warm: median of "
                       f"{len(warm)})"))
    print(f"  total to first token: cold {cold['total_s']:.1f} s, warm {med.get('total_s', float('nan')):.1f} s; "
          f"cache files after the cold run: {cold['cache_files_after']}; load average {os.getloadavg()[0]:.1f}")
    common.report("startup", argv, model={"model": args.model or "default"}, config=vars(args),
                  results={"cold": cold, "warm": warm, "warm_median": med, "loadavg": os.getloadavg(),
                           "speedup_total": cold["total_s"] / med["total_s"] if med else None},
                  out=args.out, jax_devices=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
