"""`jaxserve bench startup`: time from process start to the first generated token, cold vs warm.

Each run is a fresh subprocess. "cold" points the XLA persistent compilation cache at an empty
directory (JAXSERVE_COMPILATION_CACHE); "warm" runs again on the directory the cold run filled.
The model file itself comes from the OS page cache after the first run in both cases (not
controlled: that needs root to drop caches).

  --mode llm    python -c: import jaxserve -> LLM(model) -> precompile every step bucket -> one token
  --mode serve  `jaxserve serve` -> /health ok -> one streamed /v1/completions token over HTTP

Reported per run: total (parent's clock, spawn -> first token) and, for llm mode, the phases
(interpreter + imports, model load + placement, compile, first token).

    jaxserve bench startup [--mode llm|serve] [--model PATH] [--repeats 2] [--engine-args "..."] [--out f.json]
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


def _cache_files(path: str) -> int:
    return sum(len(f) for _, _, f in os.walk(path)) if os.path.isdir(path) else 0


def run_llm(model: str | None, engine_kw: dict, precompile: bool, cache_dir: str) -> dict:
    env = {**os.environ, "JAXSERVE_COMPILATION_CACHE": cache_dir, "TF_CPP_MIN_LOG_LEVEL": "2"}
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, model or "", json.dumps(engine_kw), "1" if precompile else "0"],
                          capture_output=True, text=True, env=env, cwd=common.REPO, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"start-up run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(line[7:])
    return {"total_s": r["t_first"] - t_spawn, "interpreter_and_imports_s": r["t_import"] - t_spawn,
            "load_s": r["t_load"] - r["t_import"], "compile_s": r["t_compile"] - r["t_load"],
            "first_token_s": r["t_first"] - r["t_compile"], "compiles": r["compiles"],
            "cache_files_after": _cache_files(cache_dir)}


def run_serve(model: str | None, server_args: str, cache_dir: str, timeout: float) -> dict:
    import httpx

    from bench.serve import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"] + (["--model", model] if model else []) + shlex.split(server_args)
    env = {**os.environ, "JAXSERVE_COMPILATION_CACHE": cache_dir, "TF_CPP_MIN_LOG_LEVEL": "2"}
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finally
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=common.REPO,
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
    finally:
        common.stop_server(proc)
        log.close()
    return {"total_s": t_first - t0, "healthy_s": t_health - t0, "first_token_after_healthy_s": t_first - t_health,
            "cache_files_after": _cache_files(cache_dir), "command": shlex.join(cmd)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench startup", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=("llm", "serve"), default="llm")
    p.add_argument("--model", "-m", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--repeats", type=int, default=2, help="warm runs (default 2); the median is reported")
    p.add_argument("--engine-args", default="",
                   help='llm mode: EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 64}\'; '
                   'serve mode: extra `jaxserve serve` arguments')
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="llm mode: compile on first use instead of every bucket up front")
    p.add_argument("--cache-dir", default=None, help="compilation cache dir to use (default: a new temp dir)")
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

    def once() -> dict:
        if args.mode == "llm":
            return run_llm(args.model, engine_kw, args.precompile, cache)
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
    keys = [k for k, v in cold.items() if isinstance(v, float)]
    med = {k: sorted(w[k] for w in warm)[len(warm) // 2] for k in keys} if warm else {}
    rows = [(k.removesuffix("_s"), cold[k], med.get(k)) for k in keys]
    print(common.table(rows, ("seconds", "cold", "warm (median)"),
                       f"Start-up to first token ({args.mode} mode, precompile={args.precompile})"))
    print(f"  compilation cache entries after the cold run: {cold['cache_files_after']}")
    common.report("startup", argv, model={"model": args.model or "default"}, config=vars(args),
                  results={"cold": cold, "warm": warm, "warm_median": med,
                           "speedup_total": cold["total_s"] / med["total_s"] if med else None},
                  out=args.out, jax_devices=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
